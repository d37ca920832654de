// Bytes per element of a hidden-state wire dtype, for the server's checks
// and the clients' request writers alike.
#ifndef DETLOGP_PROTO_DTYPE_BYTES_H_
#define DETLOGP_PROTO_DTYPE_BYTES_H_

#include <cstdint>

#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::v1 {

// 4 for FLOAT32, 2 for BFLOAT16 and FLOAT16, 0 for any other value.
inline int64_t DTypeBytes(int dtype) {
  switch (dtype) {
    case DTYPE_FLOAT32:
      return 4;
    case DTYPE_BFLOAT16:
    case DTYPE_FLOAT16:
      return 2;
    default:
      return 0;
  }
}

}  // namespace detlogp::v1

#endif  // DETLOGP_PROTO_DTYPE_BYTES_H_
