#include "server/text_stream.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvsparse::server {
namespace {

// Feeds `pieces` and records what each Push returned; Finish is appended as a last element.
std::vector<std::string> FeedAll(TextStream& stream, const std::vector<std::string>& pieces) {
  std::vector<std::string> out;
  for (const std::string& p : pieces) out.push_back(stream.Push(p));
  out.push_back(stream.Finish());
  return out;
}

std::string Joined(const std::vector<std::string>& parts) {
  std::string all;
  for (const std::string& p : parts) all += p;
  return all;
}

TEST(TextStream, PlainTextPassesThroughImmediately) {
  TextStream stream({});
  EXPECT_EQ(FeedAll(stream, {"Hello", ",", " world"}), (std::vector<std::string>{"Hello", ",", " world", ""}));
  EXPECT_FALSE(stream.stopped());
}

TEST(TextStream, HoldsSplitTwoByteCharacter) {
  TextStream stream({});
  const std::string e_acute = "\xC3\xA9";  // é
  EXPECT_EQ(stream.Push("caf\xC3"), "caf");
  EXPECT_EQ(stream.Push("\xA9!"), e_acute + "!");
  EXPECT_EQ(stream.Finish(), "");
}

TEST(TextStream, HoldsFourByteCharacterSplitOneByteAtATime) {
  TextStream stream({});
  const std::string emoji = "\xF0\x9F\x98\x80";  // 😀
  EXPECT_EQ(stream.Push("a\xF0"), "a");
  EXPECT_EQ(stream.Push("\x9F"), "");
  EXPECT_EQ(stream.Push("\x98"), "");
  EXPECT_EQ(stream.Push("\x80"), emoji);
}

TEST(TextStream, HoldsThreeByteCharacterSplitTwoPlusOne) {
  TextStream stream({});
  EXPECT_EQ(stream.Push("\xE2\x82"), "");  // €, first two bytes
  EXPECT_EQ(stream.Push("\xAC 5"), "\xE2\x82\xAC 5");
}

TEST(TextStream, FinishFlushesIncompleteTail) {
  TextStream stream({});
  EXPECT_EQ(stream.Push("x\xE2\x82"), "x");
  EXPECT_EQ(stream.Finish(), "\xE2\x82");
  EXPECT_EQ(stream.Finish(), "");
}

TEST(TextStream, InvalidBytesAreNotHeldForever) {
  TextStream stream({});
  // A stray continuation byte and an invalid lead byte can never become valid: send them.
  EXPECT_EQ(stream.Push("a\x80"), "a\x80");
  EXPECT_EQ(stream.Push("\xFF"), "\xFF");
  EXPECT_EQ(stream.Push("\x80\x80\x80\x80"), "\x80\x80\x80\x80");
}

TEST(TextStream, StopStringInOnePiece) {
  TextStream stream({"###"});
  EXPECT_EQ(stream.Push("Answer: 42"), "Answer: 42");
  EXPECT_EQ(stream.Push("\n### next"), "\n");
  EXPECT_TRUE(stream.stopped());
  EXPECT_EQ(stream.Push("more"), "");
  EXPECT_EQ(stream.Finish(), "");
}

TEST(TextStream, StopStringSplitAcrossPieces) {
  TextStream stream({"</answer>"});
  EXPECT_EQ(stream.Push("yes</"), "yes");
  EXPECT_EQ(stream.Push("ans"), "");
  EXPECT_EQ(stream.Push("wer"), "");
  EXPECT_FALSE(stream.stopped());
  EXPECT_EQ(stream.Push(">tail"), "");
  EXPECT_TRUE(stream.stopped());
  EXPECT_EQ(stream.Finish(), "");
}

TEST(TextStream, FalseStartIsReleased) {
  TextStream stream({"</answer>"});
  EXPECT_EQ(stream.Push("a </an"), "a ");
  EXPECT_EQ(stream.Push("d b"), "</and b");  // not the stop string after all
  EXPECT_EQ(stream.Push("</"), "");
  EXPECT_EQ(stream.Finish(), "</");  // generation ended: held text is sent
  EXPECT_FALSE(stream.stopped());
}

TEST(TextStream, OverlappingPrefixRestartsMatch) {
  // "aab" must be found although the text first looks like "aa" then "aab".
  TextStream stream({"aab"});
  EXPECT_EQ(stream.Push("xa"), "x");
  EXPECT_EQ(stream.Push("a"), "");
  EXPECT_EQ(stream.Push("a"), "a");  // "aaa": only the last "aa" may start the stop
  EXPECT_EQ(stream.Push("b!"), "");
  EXPECT_TRUE(stream.stopped());
}

TEST(TextStream, EarliestOfSeveralStopStringsWins) {
  TextStream stream({"world", "lo w"});
  EXPECT_EQ(stream.Push("hello world"), "hel");
  EXPECT_TRUE(stream.stopped());
}

TEST(TextStream, HoldsLongestCandidatePrefixAmongStops) {
  TextStream stream({"\nUser:", "\n\n"});
  EXPECT_EQ(stream.Push("ok\n"), "ok");  // "\n" starts both
  EXPECT_EQ(stream.Push("Us"), "");      // "\nUs" still starts "\nUser:"
  EXPECT_EQ(stream.Push("a"), "\nUsa");
}

TEST(TextStream, MultiByteStopStringSplitInsideCharacter) {
  const std::string stop = "\xE3\x80\x82";  // 。 (U+3002)
  TextStream stream({stop});
  EXPECT_EQ(stream.Push("\xE5\xA5\xBD\xE3"), "\xE5\xA5\xBD");  // 好 then the first byte of 。
  EXPECT_EQ(stream.Push("\x80"), "");
  EXPECT_EQ(stream.Push("\x82\xE5\x90\x97"), "");
  EXPECT_TRUE(stream.stopped());
}

TEST(TextStream, UnicodeTextSplitAtEveryByteReassemblesExactly) {
  const std::string text = "na\xC3\xAFve \xE2\x82\xAC \xF0\x9F\x98\x80 end";
  TextStream stream({});
  std::vector<std::string> pieces;
  for (char c : text) pieces.emplace_back(1, c);
  std::vector<std::string> out = FeedAll(stream, pieces);
  EXPECT_EQ(Joined(out), text);
  // No returned chunk ends inside a character.
  for (const std::string& chunk : out) {
    if (chunk.empty()) continue;
    const unsigned char last = static_cast<unsigned char>(chunk.back());
    EXPECT_TRUE(last < 0x80 || (last & 0xC0) == 0x80) << "chunk ends with a lead byte";
    EXPECT_FALSE((static_cast<unsigned char>(chunk.front()) & 0xC0) == 0x80) << "chunk starts mid-character";
  }
}

TEST(TextStream, StopAtVeryStartReturnsNothing) {
  TextStream stream({"<|end|>"});
  EXPECT_EQ(stream.Push("<|end|>"), "");
  EXPECT_TRUE(stream.stopped());
}

TEST(TextStream, EmptyStopStringsAreIgnored) {
  TextStream stream({"", "zz"});
  EXPECT_EQ(stream.Push("abc"), "abc");
  EXPECT_FALSE(stream.stopped());
}

TEST(TextStream, EmptyPiecesAreHarmless) {
  TextStream stream({"stop"});
  EXPECT_EQ(stream.Push(""), "");
  EXPECT_EQ(stream.Push("st"), "");
  EXPECT_EQ(stream.Push(""), "");
  EXPECT_EQ(stream.Push("op"), "");
  EXPECT_TRUE(stream.stopped());
}

}  // namespace
}  // namespace kvsparse::server
