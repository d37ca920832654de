// `--help` on detlogp_server and detlogp_cli lists their flags with defaults.
//
// Abseil's --help lists only flags defined in a file named after the program;
// both binaries define theirs in main.cc / cli_main.cc and widen the filter in
// main. This test runs the built binaries (data dependencies) and checks that
// every ABSL_FLAG in those files is listed, and that known defaults appear.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace {

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return absl::StrCat(srcdir != nullptr ? srcdir : ".", "/detlogp/", path);
}

// Runs `binary arguments`; returns whether it exited normally and its output
// (stdout and stderr).
std::pair<bool, std::string> Run(const std::string& binary,
                                 const std::string& arguments) {
  const std::string command = Runfile(binary) + " " + arguments + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {false, "popen failed"};
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0)
    output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status), output};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Names of the flags a source file defines with ABSL_FLAG(type, name, ...).
std::set<std::string> DefinedFlags(const std::string& source) {
  static const std::regex kFlag(R"(ABSL_FLAG\(\s*[^,]+,\s*(\w+)\s*,)");
  std::set<std::string> names;
  for (auto it = std::sregex_iterator(source.begin(), source.end(), kFlag);
       it != std::sregex_iterator(); ++it) {
    names.insert((*it)[1].str());
  }
  return names;
}

// Abseil prints each flag as "    --name (help); default: value;", wrapped
// over lines indented by six spaces (a wrapped line may itself start with
// "--"). Returns name -> default as printed.
std::map<std::string, std::string> ListedFlags(const std::string& help) {
  std::string joined;  // One entry per line: wrapped lines joined with a space.
  for (absl::string_view line : absl::StrSplit(help, '\n')) {
    absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(line);
    if (absl::StartsWith(line, "    --")) {
      absl::StrAppend(&joined, "\n", trimmed);
    } else if (!trimmed.empty() && !joined.empty()) {
      absl::StrAppend(&joined, " ", trimmed);
    }
  }
  std::map<std::string, std::string> flags;
  for (absl::string_view entry :
       absl::StrSplit(joined, '\n', absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&entry, "--")) continue;
    const size_t space = entry.find(' ');
    const std::string name(entry.substr(0, space));
    const size_t at = entry.rfind("; default: ");
    if (space == absl::string_view::npos || at == absl::string_view::npos)
      continue;
    absl::string_view value = entry.substr(at + 11);
    absl::ConsumeSuffix(&value, ";");
    flags[name] = std::string(value);
  }
  return flags;
}

void ExpectListsEveryFlag(const std::string& binary, const std::string& source,
                          const std::string& help_flag,
                          const std::map<std::string, std::string>& defaults) {
  auto [exited, help] = Run(binary, help_flag);
  ASSERT_TRUE(exited) << help;
  EXPECT_EQ(help.find("No flags matched"), std::string::npos) << help;
  const std::map<std::string, std::string> listed = ListedFlags(help);
  const std::set<std::string> defined = DefinedFlags(ReadFile(Runfile(source)));
  ASSERT_GT(defined.size(), 10u) << "no ABSL_FLAG found in " << source;
  for (const std::string& name : defined) {
    EXPECT_EQ(listed.count(name), 1u)
        << binary << " " << help_flag << " does not list --" << name << ":\n"
        << help;
  }
  for (const auto& [name, value] : defaults) {
    auto it = listed.find(name);
    ASSERT_NE(it, listed.end()) << "--" << name << " missing:\n" << help;
    EXPECT_EQ(it->second, value) << "--" << name;
  }
}

TEST(HelpFlagsTest, ServerHelpListsEveryFlagWithDefaults) {
  const std::map<std::string, std::string> defaults = {
      {"host", "\"127.0.0.1\""},       {"port", "50051"},
      {"device", "\"auto\""},          {"lm_head_tensor", "\"\""},
      {"max_versions_per_model", "2"}, {"max_message_mb", "640"},
      {"shared_memory_idle_s", "300"}, {"max_request_rows", "65536"},
  };
  for (const char* help_flag : {"--help", "--helpshort"}) {
    SCOPED_TRACE(help_flag);
    ExpectListsEveryFlag("server/detlogp_server", "server/main.cc", help_flag,
                         defaults);
  }
}

TEST(HelpFlagsTest, CliHelpListsEveryFlagWithDefaults) {
  const std::map<std::string, std::string> defaults = {
      {"target", "\"127.0.0.1:50051\""},
      {"timeout_s", "60"},
      {"project_rows", "4096"},
      {"rows_per_chunk", "0"},
      {"probes", "16"},
      {"chunk_mb", "4"},
      {"lm_head_tensor", "\"\""},
      {"servers", "\"\""},
      {"project_malloc_tuning", "false"},
  };
  for (const char* help_flag : {"--help", "--helpshort"}) {
    SCOPED_TRACE(help_flag);
    ExpectListsEveryFlag("client/detlogp_cli", "client/cli_main.cc", help_flag,
                         defaults);
  }
}

}  // namespace
