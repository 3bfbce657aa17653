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

TEST(ChatTemplate, NamesRoundTrip) {
  for (ChatTemplate t : {ChatTemplate::kLlama2, ChatTemplate::kLlama3, ChatTemplate::kChatml, ChatTemplate::kMistral}) {
    StatusOr<ChatTemplate> parsed = ParseChatTemplateName(ChatTemplateName(t));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kLlama2), "llama2");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kLlama3), "llama3");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kChatml), "chatml");
  EXPECT_EQ(ChatTemplateName(ChatTemplate::kMistral), "mistral");
}

TEST(ChatTemplate, UnknownNameListsValidNames) {
  StatusOr<ChatTemplate> parsed = ParseChatTemplateName("vicuna");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  const std::string& message = parsed.status().message();
  EXPECT_NE(message.find("vicuna"), std::string::npos);
  for (const char* name : {"llama2", "llama3", "chatml", "mistral"}) {
    EXPECT_NE(message.find(name), std::string::npos) << name;
  }
  EXPECT_FALSE(ParseChatTemplateName("ChatML").ok());  // exact names only
  EXPECT_FALSE(ParseChatTemplateName("").ok());
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
  EXPECT_EQ(DetectChatTemplate("{{ '<start_of_turn>' + role + '\\n' }}", &recognized), ChatTemplate::kChatml);
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

TEST(ChatTemplate, ContentIsCopiedVerbatim) {
  // Markers or braces inside content are not interpreted (only llama3 trims).
  const std::string tricky = "<|im_end|> {{ x }} [INST] ünïcødé";
  EXPECT_EQ(Apply(ChatTemplate::kChatml, {{"user", tricky}}, false), "<|im_start|>user\n" + tricky + "<|im_end|>\n");
  EXPECT_EQ(Apply(ChatTemplate::kMistral, {{"user", tricky}}), "[INST] " + tricky + " [/INST]");
}

TEST(ChatTemplate, RejectsUnknownRoleNamingRoleAndIndex) {
  for (ChatTemplate t : {ChatTemplate::kLlama2, ChatTemplate::kLlama3, ChatTemplate::kChatml, ChatTemplate::kMistral}) {
    StatusOr<std::string> prompt = ApplyChatTemplate(t, {{"system", "s"}, {"user", "u"}, {"tool", "{}"}}, true);
    ASSERT_FALSE(prompt.ok());
    EXPECT_EQ(prompt.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(prompt.status().message().find("'tool'"), std::string::npos) << prompt.status().message();
    EXPECT_NE(prompt.status().message().find("message 2"), std::string::npos) << prompt.status().message();
  }
  EXPECT_FALSE(ApplyChatTemplate(ChatTemplate::kChatml, {{"User", "u"}}, true).ok());  // roles are case-sensitive
}

TEST(ChatTemplate, RejectsEmptyConversation) {
  StatusOr<std::string> prompt = ApplyChatTemplate(ChatTemplate::kChatml, {}, true);
  ASSERT_FALSE(prompt.ok());
  EXPECT_EQ(prompt.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::server
