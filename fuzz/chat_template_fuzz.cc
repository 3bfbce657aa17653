// Chat templates: the GGUF tokenizer.chat_template text goes through detection, and messages
// taken from the input (lines "role:content", any role) render under every format.
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "server/chat_template.h"

namespace kvsparse::fuzz {

int FuzzChatTemplate(const uint8_t* data, size_t size) {
  const std::string text(AsText(data, size));
  (void)server::DetectChatTemplate(text);
  (void)server::ParseChatTemplateName(text);
  std::vector<server::ChatMessage> messages;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line) && messages.size() < 32;) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) {
      messages.push_back({"user", line});
    } else {
      messages.push_back({line.substr(0, colon), line.substr(colon + 1)});
    }
  }
  for (auto format : {server::ChatTemplate::kChatml, server::ChatTemplate::kLlama2, server::ChatTemplate::kLlama3,
                      server::ChatTemplate::kMistral, server::ChatTemplate::kGemma, server::ChatTemplate::kPhi3}) {
    for (bool add_generation_prompt : {false, true}) {
      (void)server::ApplyChatTemplate(format, messages, add_generation_prompt);
    }
  }
  return 0;
}

}  // namespace kvsparse::fuzz
