#pragma once
// Invariant checks. DI_CHECK runs in debug builds only (setup.py defines NDEBUG for release);
// DI_REQUIRE always runs and guards the API boundary. Both throw std exceptions, which pybind11
// translates into Python errors (invalid_argument -> ValueError, logic_error -> RuntimeError).
#include <stdexcept>
#include <string>

#define DI_REQUIRE(cond, msg)                                                   \
  do {                                                                          \
    if (!(cond)) throw std::invalid_argument(std::string(msg));                 \
  } while (0)

#ifdef NDEBUG
#define DI_CHECK(cond, msg) \
  do {                      \
  } while (0)
#else
#define DI_CHECK(cond, msg)                                                              \
  do {                                                                                   \
    if (!(cond))                                                                         \
      throw std::logic_error(std::string("invariant violated: ") + (msg) + " at " +     \
                             __FILE__ + ":" + std::to_string(__LINE__));                 \
  } while (0)
#endif
