#include "server/chat_template.h"

#include <array>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace kvsparse::server {
namespace {

constexpr std::array<std::pair<ChatTemplate, std::string_view>, 9> kTemplateNames = {{
    {ChatTemplate::kLlama2, "llama2"},
    {ChatTemplate::kLlama3, "llama3"},
    {ChatTemplate::kChatml, "chatml"},
    {ChatTemplate::kMistral, "mistral"},
    {ChatTemplate::kGemma, "gemma"},
    {ChatTemplate::kPhi3, "phi3"},
    {ChatTemplate::kDeepseek2, "deepseek2"},
    {ChatTemplate::kDeepseek3, "deepseek3"},
    {ChatTemplate::kHarmony, "gpt-oss"},
}};

// DeepSeek's full-width markers (U+FF5C and U+2581 inside).
constexpr std::string_view kDeepseekEnd = "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
constexpr std::string_view kDeepseekUser = "<\xef\xbd\x9c" "User\xef\xbd\x9c>";
constexpr std::string_view kDeepseekAssistant = "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

// The C-locale isspace set, as llama.cpp's trim uses.
bool IsAsciiSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

std::string_view Trim(std::string_view text) {
  while (!text.empty() && IsAsciiSpace(text.front())) text.remove_prefix(1);
  while (!text.empty() && IsAsciiSpace(text.back())) text.remove_suffix(1);
  return text;
}

void AppendChatml(const std::vector<ChatMessage>& messages, bool add_generation_prompt, std::string& out) {
  for (const ChatMessage& m : messages) {
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    out += m.content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
}

// DeepSeek-V2 (plain "User:" / "Assistant:" turns) and V3 (full-width markers): the system
// text opens the prompt as it stands.
void AppendDeepseek(const std::vector<ChatMessage>& messages, bool v3, bool add_generation_prompt, std::string& out) {
  for (const ChatMessage& m : messages) {
    if (m.role == "system") {
      out += m.content;
      out += "\n\n";
    } else if (m.role == "user") {
      out += v3 ? kDeepseekUser : "User: ";
      out += m.content;
      if (!v3) out += "\n\n";
    } else {
      out += v3 ? kDeepseekAssistant : "Assistant: ";
      out += m.content;
      out += kDeepseekEnd;
    }
  }
  if (add_generation_prompt) out += v3 ? kDeepseekAssistant : "Assistant:";
}

void AppendHarmony(const std::vector<ChatMessage>& messages, bool add_generation_prompt, std::string& out) {
  for (const ChatMessage& m : messages) {
    out += "<|start|>";
    out += m.role;
    out += "<|message|>";
    out += m.content;
    out += m.role == "assistant" ? "<|return|>" : "<|end|>";
  }
  if (add_generation_prompt) out += "<|start|>assistant";
}

void AppendLlama3(const std::vector<ChatMessage>& messages, bool add_generation_prompt, std::string& out) {
  for (const ChatMessage& m : messages) {
    out += "<|start_header_id|>";
    out += m.role;
    out += "<|end_header_id|>\n\n";
    out += Trim(m.content);  // llama.cpp trims each message for this format
    out += "<|eot_id|>";
  }
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
}

// Gemma has no system turn: the system text (trimmed; several system messages are joined as they
// are) waits for the next user turn and opens it, followed by a blank line. A system text that no
// user turn follows is dropped. The assistant role is "model"; every message is trimmed.
void AppendGemma(const std::vector<ChatMessage>& messages, bool add_generation_prompt, std::string& out) {
  std::string pending_system;
  for (const ChatMessage& m : messages) {
    if (m.role == "system") {
      pending_system += Trim(m.content);
      continue;
    }
    const bool is_model = m.role == "assistant";
    out += "<start_of_turn>";
    out += is_model ? std::string_view("model") : std::string_view(m.role);
    out += '\n';
    if (!is_model && !pending_system.empty()) {
      out += pending_system;
      out += "\n\n";
      pending_system.clear();
    }
    out += Trim(m.content);
    out += "<end_of_turn>\n";
  }
  if (add_generation_prompt) out += "<start_of_turn>model\n";
}

// Phi-3: every role, system included, as its own <|role|> turn; content as it is.
void AppendPhi3(const std::vector<ChatMessage>& messages, bool add_generation_prompt, std::string& out) {
  for (const ChatMessage& m : messages) {
    out += "<|";
    out += m.role;
    out += "|>\n";
    out += m.content;
    out += "<|end|>\n";
  }
  if (add_generation_prompt) out += "<|assistant|>\n";
}

// Both [INST] formats: a turn opens with "[INST] ", a user message closes it for the model with
// " [/INST]", and an assistant reply ends with "</s>", after which the next message opens a new
// turn. They differ only in how a system message is written.
void AppendInst(const std::vector<ChatMessage>& messages, bool system_block, std::string& out) {
  bool inside_turn = true;
  out += "[INST] ";
  for (const ChatMessage& m : messages) {
    if (!inside_turn) {
      out += "[INST] ";
      inside_turn = true;
    }
    if (m.role == "system") {
      if (system_block) {
        out += "<<SYS>>\n";
        out += m.content;
        out += "\n<</SYS>>\n\n";
      } else {
        out += m.content;
        out += '\n';
      }
    } else if (m.role == "user") {
      out += m.content;
      out += " [/INST]";
    } else {
      out += m.content;
      out += "</s>";
      inside_turn = false;
    }
  }
}

}  // namespace

std::string_view ChatTemplateName(ChatTemplate chat_template) {
  for (const auto& [value, name] : kTemplateNames) {
    if (value == chat_template) return name;
  }
  KVS_CHECK_MSG(false, "unknown ChatTemplate value");
  return {};
}

StatusOr<ChatTemplate> ParseChatTemplateName(std::string_view name) {
  for (const auto& [value, known] : kTemplateNames) {
    if (known == name) return value;
  }
  std::string valid;
  for (const auto& [value, known] : kTemplateNames) {
    if (!valid.empty()) valid += ", ";
    valid += known;
  }
  return InvalidArgumentError(fmt::format("unknown chat template '{}' (valid: {})", name, valid));
}

ChatTemplate DetectChatTemplate(std::string_view jinja_template, bool* recognized) {
  auto found = [&](ChatTemplate t) {
    if (recognized != nullptr) *recognized = true;
    return t;
  };
  // A bare name, as llama.cpp accepts for its built-in templates.
  for (const auto& [value, name] : kTemplateNames) {
    if (jinja_template == name) return found(value);
  }
  // Same order as llama.cpp: chatml first, since some chatml templates mention other markers
  // (Qwen3's, with its <think> and <tool_call> handling, is plain chatml there too).
  if (Contains(jinja_template, "<|im_start|>")) return found(ChatTemplate::kChatml);
  if (Contains(jinja_template, "[INST]")) {
    return found(Contains(jinja_template, "<<SYS>>") ? ChatTemplate::kLlama2 : ChatTemplate::kMistral);
  }
  if (Contains(jinja_template, "<|assistant|>") && Contains(jinja_template, "<|end|>")) {
    return found(ChatTemplate::kPhi3);
  }
  if (Contains(jinja_template, "<start_of_turn>")) return found(ChatTemplate::kGemma);
  if (Contains(jinja_template, "<|start_header_id|>") && Contains(jinja_template, "<|end_header_id|>")) {
    return found(ChatTemplate::kLlama3);
  }
  if (Contains(jinja_template, "'Assistant: ' + message['content'] + eos_token")) return found(ChatTemplate::kDeepseek2);
  if (Contains(jinja_template, kDeepseekAssistant) && Contains(jinja_template, kDeepseekUser) &&
      Contains(jinja_template, kDeepseekEnd)) {
    return found(ChatTemplate::kDeepseek3);
  }
  if (Contains(jinja_template, "<|start|>") && Contains(jinja_template, "<|channel|>")) {
    return found(ChatTemplate::kHarmony);
  }
  if (recognized != nullptr) *recognized = false;
  return ChatTemplate::kChatml;
}

StatusOr<std::string> ApplyChatTemplate(ChatTemplate chat_template, const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt) {
  if (messages.empty()) return InvalidArgumentError("chat template: no messages");
  size_t content_bytes = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return InvalidArgumentError(fmt::format(
          "chat template: message {} has role '{}' (valid roles: system, user, assistant)", i, role));
    }
    content_bytes += messages[i].content.size();
  }
  std::string out;
  out.reserve(content_bytes + 48 * messages.size() + 64);  // content plus the markers around each turn
  switch (chat_template) {
    case ChatTemplate::kChatml: AppendChatml(messages, add_generation_prompt, out); break;
    case ChatTemplate::kLlama3: AppendLlama3(messages, add_generation_prompt, out); break;
    case ChatTemplate::kLlama2: AppendInst(messages, /*system_block=*/true, out); break;
    case ChatTemplate::kMistral: AppendInst(messages, /*system_block=*/false, out); break;
    case ChatTemplate::kGemma: AppendGemma(messages, add_generation_prompt, out); break;
    case ChatTemplate::kPhi3: AppendPhi3(messages, add_generation_prompt, out); break;
    case ChatTemplate::kDeepseek2: AppendDeepseek(messages, /*v3=*/false, add_generation_prompt, out); break;
    case ChatTemplate::kDeepseek3: AppendDeepseek(messages, /*v3=*/true, add_generation_prompt, out); break;
    case ChatTemplate::kHarmony: AppendHarmony(messages, add_generation_prompt, out); break;
  }
  return out;
}

}  // namespace kvsparse::server
