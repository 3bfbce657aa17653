// Chat prompt formats: turn an OpenAI-style message list into the prompt text a chat model was
// trained on, byte for byte as llama.cpp's built-in (non-Jinja) formatter writes it for the same
// template, so a model served here sees the prompt it would see under llama-server.
//
// The BOS token is never written as text: the tokenizer adds it (add_special). End-of-turn
// markers ("<|im_end|>", "<|eot_id|>", "</s>", "<end_of_turn>", "<|end|>") are written as text, so
// the prompt must be tokenized with special-token parsing on.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse::server {

enum class ChatTemplate {
  kLlama2,   // [INST] with a <<SYS>> block in the first user turn (llama.cpp "llama2-sys")
  kLlama3,   // <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|>
  kChatml,   // <|im_start|>role\n content <|im_end|>\n
  kMistral,  // [INST] without <<SYS>>: system text and "\n" open the first user turn. This is what
             // llama.cpp writes for such templates (Mistral-7B-Instruct v0.1/v0.2; its "llama2"
             // formatter), not its leading-space "mistral-v1" variant
  kGemma,    // <start_of_turn>role\n content <end_of_turn>\n, the assistant written as "model"
             // (Gemma, Gemma 2, Gemma 3). No system turn: the system text, trimmed, and "\n\n" open
             // the next user turn. Every message is trimmed, as in llama.cpp
  kPhi3,     // <|role|>\n content <|end|>\n, system included (Phi-3, Phi-3.5 mini)
  kDeepseek2,  // "User: " content "\n\n", "Assistant: " content <｜end▁of▁sentence｜>, the system
               // text and "\n\n" as it stands; the prompt ends with "Assistant:" (DeepSeek-V2)
  kDeepseek3,  // <｜User｜> content, <｜Assistant｜> content <｜end▁of▁sentence｜>, the system text
               // and "\n\n"; the prompt ends with <｜Assistant｜> (DeepSeek-V3, R1)
  kHarmony,    // gpt-oss's harmony format as llama.cpp's built-in writes it: <|start|>role
               // <|message|> content, then <|end|> (<|return|> after an assistant turn); the prompt
               // ends with <|start|>assistant, so the model writes its channel itself
};

// "llama2", "llama3", "chatml", "mistral", "gemma", "phi3", "deepseek2", "deepseek3", "gpt-oss"
// (llama.cpp's names for these formats).
std::string_view ChatTemplateName(ChatTemplate chat_template);

// Inverse of ChatTemplateName (exact, lower case); the error lists the valid names.
StatusOr<ChatTemplate> ParseChatTemplateName(std::string_view name);

// Picks the format from the GGUF `tokenizer.chat_template` Jinja source by the signature
// substrings llama.cpp looks for, tested in llama.cpp's order: "<|im_start|>" (chatml, so Qwen2/3
// templates with <think> handling are chatml too), "[INST]" (llama2 with "<<SYS>>", else
// mistral), "<|assistant|>" with "<|end|>" (phi3), "<start_of_turn>" (gemma), then
// "<|start_header_id|>" with "<|end_header_id|>" (llama3), "'Assistant: ' + message['content'] +
// eos_token" (deepseek2), <｜Assistant｜> with <｜User｜> and <｜end▁of▁sentence｜> (deepseek3), then
// "<|start|>" with "<|channel|>" (gpt-oss's harmony). A string that is exactly a template
// name selects it. An empty or unrecognised template falls back to chatml; `recognized`
// (optional) tells which happened, so the server can log the fallback.
ChatTemplate DetectChatTemplate(std::string_view jinja_template, bool* recognized = nullptr);

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// The prompt text for `messages`. With add_generation_prompt, chatml, llama3, gemma and phi3 end
// with an open assistant header ("<start_of_turn>model\n" for gemma, "<|assistant|>\n" for phi3);
// the [INST] formats need nothing (a user turn already ends with "[/INST]"), so for them the flag
// changes nothing, as in llama.cpp. Errors (InvalidArgument): no messages, or a
// role other than system/user/assistant (the message names the role and the message index).
StatusOr<std::string> ApplyChatTemplate(ChatTemplate chat_template, const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt);

}  // namespace kvsparse::server
