// ASSERT_OK(expr): the absl::Status `expr` is OK, else the test stops
// naming the expression and the status.
#ifndef DETLOGP_TESTS_ASSERT_OK_H_
#define DETLOGP_TESTS_ASSERT_OK_H_

#include <gtest/gtest.h>

#include "absl/status/status.h"

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status _s = (expr);              \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s; \
  } while (0)

#endif  // DETLOGP_TESTS_ASSERT_OK_H_
