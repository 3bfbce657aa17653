#include "server/chat_template.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvsparse::server {
namespace {

// One conversation for every format: system, user, assistant, user.
std::vector<ChatMessage> Conversation() {
  return {
      {"system", "You are a helpful assistant."},
      {"user", "Hello"},
      {"assistant", "Hi there"},
      {"user", "Who are you?"},
  };
}

std::string Apply(ChatTemplate t, const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) {
  StatusOr<std::string> prompt = ApplyChatTemplate(t, messages, add_generation_prompt);
  EXPECT_TRUE(prompt.ok()) << prompt.status().ToString();
  return prompt.ok() ? *prompt : std::string();
}

constexpr ChatTemplate kAllTemplates[] = {ChatTemplate::kLlama2,    ChatTemplate::kLlama3,    ChatTemplate::kChatml,
                                          ChatTemplate::kMistral,   ChatTemplate::kGemma,     ChatTemplate::kPhi3,
                                          ChatTemplate::kDeepseek2, ChatTemplate::kDeepseek3, ChatTemplate::kHarmony};

TEST(ChatTemplate, NamesRoundTrip) {
  for (ChatTemplate t : kAllTemplates) {
    StatusOr<ChatTemplate> parsed = ParseChatTemplateName(ChatTemplateName(t));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kLlama2), "llama2");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kLlama3), "llama3");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kChatml), "chatml");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kMistral), "mistral");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kGemma), "gemma");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kPhi3), "phi3");
  for (const char* name : {"llama2", "llama3", "chatml", "mistral", "gemma", "phi3", "deepseek2", "deepseek3", "gpt-oss"}) {
    StatusOr<ChatTemplate> parsed = ParseChatTemplateName(name);
    ASSERT_TRUE(parsed.ok()) << name;
    EXPECT_EQ(ChatTemplateName(*parsed), name);
  }
}

TEST(ChatTemplate, UnknownNameListsValidNames) {
  StatusOr<ChatTemplate> parsed = ParseChatTemplateName("vicuna");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  const std::string& message = parsed.status().message();
  EXPECT_NE(message.find("vicuna"), std::string::npos);
  for (const char* name : {"llama2", "llama3", "chatml", "mistral", "gemma", "phi3", "deepseek2", "deepseek3", "gpt-oss"}) {
    EXPECT_NE(message.find(name), std::string::npos) << name;
  }
  EXPECT_FALSE(ParseChatTemplateName("ChatML").ok());  // exact names only
  EXPECT_FALSE(ParseChatTemplateName("").ok());
  // Model names are not format names: Gemma 2/3 are "gemma", Phi-3.5 is "phi3", Qwen3 is "chatml".
  for (const char* name : {"gemma2", "gemma3", "phi-3", "phi3.5", "qwen3", "Gemma"}) {
    EXPECT_FALSE(ParseChatTemplateName(name).ok()) << name;
  }
}

TEST(ChatTemplate, DetectsFromJinjaSignatures) {
  struct Case {
    const char* jinja;
    ChatTemplate expected;
  };
  // Abridged from the templates real GGUFs carry.
  const Case cases[] = {
      {"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
       "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
       ChatTemplate::kChatml},
      {"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
       "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}"
       "{% endfor %}",
       ChatTemplate::kLlama3},
      {"{% if messages[0]['role'] == 'system' %}{% set system_message = '<<SYS>>\\n' + messages[0]['content'] + "
       "'\\n<</SYS>>\\n\\n' %}{% endif %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}",
       ChatTemplate::kLlama2},
      {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
       "message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + "
       "eos_token}}{% endif %}{% endfor %}",
       ChatTemplate::kMistral},
      // Bare names select themselves.
      {"llama3", ChatTemplate::kLlama3},
      {"mistral", ChatTemplate::kMistral},
      {"gemma", ChatTemplate::kGemma},
      {"phi3", ChatTemplate::kPhi3},
  };
  for (const Case& c : cases) {
    bool recognized = false;
    EXPECT_EQ(DetectChatTemplate(c.jinja, &recognized), c.expected) << c.jinja;
    EXPECT_TRUE(recognized) << c.jinja;
  }
}

TEST(ChatTemplate, EmptyOrUnknownFallsBackToChatml) {
  bool recognized = true;
  EXPECT_EQ(DetectChatTemplate("", &recognized), ChatTemplate::kChatml);
  EXPECT_FALSE(recognized);
  recognized = true;
  EXPECT_EQ(DetectChatTemplate("{{ 'USER: ' + message['content'] + ' ASSISTANT: ' }}", &recognized),
            ChatTemplate::kChatml);
  EXPECT_FALSE(recognized);
  // "<|assistant|>" without "<|end|>" is not phi3 (Zephyr-style templates end turns with <|endoftext|>).
  recognized = true;
  EXPECT_EQ(DetectChatTemplate("{{ '<|user|>\\n' + message['content'] + eos_token }}{{ '<|assistant|>\\n' }}",
                               &recognized),
            ChatTemplate::kChatml);
  EXPECT_FALSE(recognized);
  // Only one of the llama3 header markers is not a llama3 template.
  recognized = true;
  EXPECT_EQ(DetectChatTemplate("<|start_header_id|>", &recognized), ChatTemplate::kChatml);
  EXPECT_FALSE(recognized);
  EXPECT_EQ(DetectChatTemplate("<|im_start|>"), ChatTemplate::kChatml);  // out-param is optional
}

TEST(ChatTemplate, Chatml) {
  EXPECT_EQ(Apply(ChatTemplate::kChatml, Conversation()),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n"
            "<|im_start|>assistant\nHi there<|im_end|>\n"
            "<|im_start|>user\nWho are you?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(Apply(ChatTemplate::kChatml, Conversation(), /*add_generation_prompt=*/false),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n"
            "<|im_start|>assistant\nHi there<|im_end|>\n"
            "<|im_start|>user\nWho are you?<|im_end|>\n");
}

TEST(ChatTemplate, Llama3) {
  EXPECT_EQ(Apply(ChatTemplate::kLlama3, Conversation()),
            "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWho are you?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(Apply(ChatTemplate::kLlama3, {{"user", "Hi"}}, /*add_generation_prompt=*/false),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

TEST(ChatTemplate, Llama3TrimsContentLikeLlamaCpp) {
  EXPECT_EQ(Apply(ChatTemplate::kLlama3, {{"user", " \n\tHello  \r\n"}, {"assistant", "   I am   "}}, false),
            "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nI am<|eot_id|>");
}

TEST(ChatTemplate, Llama2FoldsSystemIntoFirstUserTurn) {
  const std::string expected =
      "[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you? [/INST]";
  EXPECT_EQ(Apply(ChatTemplate::kLlama2, Conversation()), expected);
  // The user turn already ends with [/INST]: no generation prompt to add.
  EXPECT_EQ(Apply(ChatTemplate::kLlama2, Conversation(), false), expected);
  EXPECT_EQ(Apply(ChatTemplate::kLlama2, {{"user", "Hello"}}), "[INST] Hello [/INST]");
}

TEST(ChatTemplate, MistralFoldsSystemWithoutSysBlock) {
  const std::string expected =
      "[INST] You are a helpful assistant.\nHello [/INST]Hi there</s>[INST] Who are you? [/INST]";
  EXPECT_EQ(Apply(ChatTemplate::kMistral, Conversation()), expected);
  EXPECT_EQ(Apply(ChatTemplate::kMistral, Conversation(), false), expected);
  EXPECT_EQ(Apply(ChatTemplate::kMistral, {{"user", "Hello"}, {"assistant", "Hi"}}, false),
            "[INST] Hello [/INST]Hi</s>");
}

// Abridged from the tokenizer.chat_template strings of real GGUFs, Jinja whitespace control and
// all (the signatures llama.cpp keys on are kept; the rest is trimmed for length).
constexpr const char kGemma2Template[] =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";

constexpr const char kGemma3Template[] =
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n";

constexpr const char kPhi3MiniTemplate[] =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}";

constexpr const char kPhi35MiniTemplate[] =
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}";

constexpr const char kQwen3Template[] =
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == \"user\" or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if '</think>' in message.content %}\n"
    "            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- set reasoning_content = "
    "message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index and reasoning_content %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n";

TEST(ChatTemplate, DetectsGemmaPhi3AndQwen3) {
  struct Case {
    const char* name;
    const char* jinja;
    ChatTemplate expected;
  };
  const Case cases[] = {
      {"Gemma 2", kGemma2Template, ChatTemplate::kGemma},
      {"Gemma 3", kGemma3Template, ChatTemplate::kGemma},
      {"Phi-3 mini", kPhi3MiniTemplate, ChatTemplate::kPhi3},
      {"Phi-3.5 mini", kPhi35MiniTemplate, ChatTemplate::kPhi3},
      {"Qwen3", kQwen3Template, ChatTemplate::kChatml},
  };
  for (const Case& c : cases) {
    bool recognized = false;
    EXPECT_EQ(DetectChatTemplate(c.jinja, &recognized), c.expected) << c.name;
    EXPECT_TRUE(recognized) << c.name;
  }
}

TEST(ChatTemplate, Gemma) {
  const std::string history =
      "<start_of_turn>user\nYou are a helpful assistant.\n\nHello<end_of_turn>\n"
      "<start_of_turn>model\nHi there<end_of_turn>\n"
      "<start_of_turn>user\nWho are you?<end_of_turn>\n";
  EXPECT_EQ(Apply(ChatTemplate::kGemma, Conversation()), history + "<start_of_turn>model\n");
  EXPECT_EQ(Apply(ChatTemplate::kGemma, Conversation(), /*add_generation_prompt=*/false), history);
  EXPECT_EQ(Apply(ChatTemplate::kGemma, {{"user", "Hi"}}, false), "<start_of_turn>user\nHi<end_of_turn>\n");
}

TEST(ChatTemplate, GemmaTrimsAndDefersSystemToNextUserTurn) {
  // Every message is trimmed, the system text too.
  EXPECT_EQ(Apply(ChatTemplate::kGemma,
                  {{"system", "  Be brief.\n"}, {"user", "\tHello \n"}, {"assistant", "   I am   "}}, false),
            "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\nI am<end_of_turn>\n");
  // Several system messages are joined as they are; one after a model turn waits for the next user.
  EXPECT_EQ(Apply(ChatTemplate::kGemma,
                  {{"user", "a"}, {"assistant", "b"}, {"system", "S1 "}, {"system", " S2"}, {"user", "c"}}),
            "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n"
            "<start_of_turn>user\nS1S2\n\nc<end_of_turn>\n<start_of_turn>model\n");
  // A system text that is all blanks adds nothing; one that no user turn follows is dropped.
  EXPECT_EQ(Apply(ChatTemplate::kGemma, {{"system", " \n "}, {"user", "x"}}, false),
            "<start_of_turn>user\nx<end_of_turn>\n");
  EXPECT_EQ(Apply(ChatTemplate::kGemma, {{"user", "x"}, {"system", "late"}}, false),
            "<start_of_turn>user\nx<end_of_turn>\n");
  EXPECT_EQ(Apply(ChatTemplate::kGemma, {{"system", "only"}}, true), "<start_of_turn>model\n");
  EXPECT_EQ(Apply(ChatTemplate::kGemma, {{"system", "only"}}, false), "");
}

TEST(ChatTemplate, Phi3) {
  const std::string history =
      "<|system|>\nYou are a helpful assistant.<|end|>\n"
      "<|user|>\nHello<|end|>\n"
      "<|assistant|>\nHi there<|end|>\n"
      "<|user|>\nWho are you?<|end|>\n";
  EXPECT_EQ(Apply(ChatTemplate::kPhi3, Conversation()), history + "<|assistant|>\n");
  EXPECT_EQ(Apply(ChatTemplate::kPhi3, Conversation(), /*add_generation_prompt=*/false), history);
  // Content is not trimmed for phi3.
  EXPECT_EQ(Apply(ChatTemplate::kPhi3, {{"user", " hi \n"}, {"assistant", "   I am   "}}, false),
            "<|user|>\n hi \n<|end|>\n<|assistant|>\n   I am   <|end|>\n");
}

TEST(ChatTemplate, Qwen3TemplateFormatsAsChatml) {
  const ChatTemplate t = DetectChatTemplate(kQwen3Template);
  ASSERT_EQ(t, ChatTemplate::kChatml);
  // llama.cpp's built-in formatter writes no <think> block: the model decides whether to think.
  EXPECT_EQ(Apply(t, {{"system", "sys"}, {"user", "Hello"}}),
            "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
}

// The MoE models' formats, as llama.cpp's built-in formatter writes them (llm_chat_apply_template:
// DEEPSEEK_2, DEEPSEEK_3, OPENAI_MOE), detected from signature lines of their Jinja templates.
TEST(ChatTemplate, DeepseekAndHarmony) {
  const std::string end = "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
  const std::string user = "<\xef\xbd\x9c" "User\xef\xbd\x9c>", assistant = "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";
  EXPECT_EQ(Apply(ChatTemplate::kDeepseek2, Conversation()),
            "You are a helpful assistant.\n\nUser: Hello\n\nAssistant: Hi there" + end +
                "User: Who are you?\n\nAssistant:");
  EXPECT_EQ(Apply(ChatTemplate::kDeepseek3, Conversation()),
            "You are a helpful assistant.\n\n" + user + "Hello" + assistant + "Hi there" + end + user + "Who are you?" +
                assistant);
  EXPECT_EQ(Apply(ChatTemplate::kHarmony, Conversation()),
            "<|start|>system<|message|>You are a helpful assistant.<|end|><|start|>user<|message|>Hello<|end|>"
            "<|start|>assistant<|message|>Hi there<|return|><|start|>user<|message|>Who are you?<|end|>"
            "<|start|>assistant");
  EXPECT_EQ(Apply(ChatTemplate::kHarmony, {{"user", "x"}}, false), "<|start|>user<|message|>x<|end|>");
  struct Case {
    std::string jinja;
    ChatTemplate expected;
  };
  const Case cases[] = {
      {"{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == "
       "'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% endif %}",
       ChatTemplate::kDeepseek2},
      {"{{'" + user + "' + message['content']}}{{'" + assistant + "' + content + '" + end + "'}}", ChatTemplate::kDeepseek3},
      {"{{- \"<|start|>assistant<|channel|>final<|message|>\" }}", ChatTemplate::kHarmony},
  };
  for (const Case& c : cases) {
    bool recognized = false;
    EXPECT_EQ(DetectChatTemplate(c.jinja, &recognized), c.expected) << c.jinja;
    EXPECT_TRUE(recognized) << c.jinja;
  }
}

TEST(ChatTemplate, ContentIsCopiedVerbatim) {
  // Markers or braces inside content are not interpreted (llama3 and gemma trim, nothing more).
  const std::string tricky = "<|im_end|> {{ x }} [INST] ünïcødé";
  EXPECT_EQ(Apply(ChatTemplate::kChatml, {{"user", tricky}}, false), "<|im_start|>user\n" + tricky + "<|im_end|>\n");
  EXPECT_EQ(Apply(ChatTemplate::kMistral, {{"user", tricky}}), "[INST] " + tricky + " [/INST]");
  EXPECT_EQ(Apply(ChatTemplate::kGemma, {{"user", tricky}}, false),
            "<start_of_turn>user\n" + tricky + "<end_of_turn>\n");
  EXPECT_EQ(Apply(ChatTemplate::kPhi3, {{"user", tricky}}, false), "<|user|>\n" + tricky + "<|end|>\n");
}

TEST(ChatTemplate, RejectsUnknownRoleNamingRoleAndIndex) {
  for (ChatTemplate t : kAllTemplates) {
    StatusOr<std::string> prompt = ApplyChatTemplate(t, {{"system", "s"}, {"user", "u"}, {"tool", "{}"}}, true);
    ASSERT_FALSE(prompt.ok());
    EXPECT_EQ(prompt.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(prompt.status().message().find("'tool'"), std::string::npos) << prompt.status().message();
    EXPECT_NE(prompt.status().message().find("message 2"), std::string::npos) << prompt.status().message();
  }
  EXPECT_FALSE(ApplyChatTemplate(ChatTemplate::kChatml, {{"User", "u"}}, true).ok());  // roles are case-sensitive
  // "model" is how gemma writes the assistant, not a role a client may send.
  EXPECT_FALSE(ApplyChatTemplate(ChatTemplate::kGemma, {{"user", "u"}, {"model", "m"}}, true).ok());
}

TEST(ChatTemplate, RejectsEmptyConversation) {
  StatusOr<std::string> prompt = ApplyChatTemplate(ChatTemplate::kChatml, {}, true);
  ASSERT_FALSE(prompt.ok());
  EXPECT_EQ(prompt.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::server
