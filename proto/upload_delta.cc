#include "proto/upload_delta.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::v1 {
namespace {

int64_t TotalBytes(const PayloadParts& parts) {
  int64_t total = 0;
  for (absl::string_view part : parts)
    total += static_cast<int64_t>(part.size());
  return total;
}

// Calls visit(out_offset, source, n) for each piece of the stream bytes
// [offset, offset + size) that `parts` lay end to end: `source` points at
// the piece inside its part, `out_offset` is where it falls in the range.
template <typename Visit>
void ForEachPiece(const PayloadParts& parts, int64_t offset, int64_t size,
                  Visit visit) {
  int64_t begin = 0;
  for (absl::string_view part : parts) {
    const int64_t end = begin + static_cast<int64_t>(part.size());
    const int64_t from = std::max(offset, begin);
    const int64_t to = std::min(offset + size, end);
    if (to > from)
      visit(from - offset, part.data() + (from - begin), to - from);
    begin = end;
  }
}

// Copies `size` bytes of `parts` from `offset` on into `out`.
void ReadParts(const PayloadParts& parts, int64_t offset, char* out,
               int64_t size) {
  ForEachPiece(parts, offset, size,
               [out](int64_t at, const char* in, int64_t n) {
                 std::memcpy(out + at, in, n);
               });
}

// XORs `size` bytes of `parts` from `offset` on into `bytes`.
void XorParts(const PayloadParts& parts, int64_t offset, char* bytes,
              int64_t size) {
  ForEachPiece(parts, offset, size,
               [bytes](int64_t at, const char* in, int64_t n) {
                 char* out = bytes + at;
                 // Eight bytes at a time; the compiler vectorises the loop.
                 int64_t i = 0;
                 for (; i + 8 <= n; i += 8) {
                   uint64_t a, b;
                   std::memcpy(&a, out + i, 8);
                   std::memcpy(&b, in + i, 8);
                   a ^= b;
                   std::memcpy(out + i, &a, 8);
                 }
                 for (; i < n; ++i) out[i] ^= in[i];
               });
}

absl::Status ZstdError(size_t code, absl::string_view what) {
  return absl::InternalError(
      absl::StrCat("zstd ", what, ": ", ZSTD_getErrorName(code)));
}

}  // namespace

absl::StatusOr<std::string> EncodeXorDelta(const PayloadParts& updated,
                                           const PayloadParts& base,
                                           const XorDeltaOptions& options) {
  const int64_t total = TotalBytes(updated);
  if (TotalBytes(base) != total) {
    return FieldError(absl::StatusCode::kInvalidArgument, "base",
                      absl::StrCat("the base holds ", TotalBytes(base),
                                   " payload bytes, the new weights ", total));
  }
  if (options.block_bytes <= 0) {
    return FieldError(absl::StatusCode::kInvalidArgument, "block_bytes",
                      "must be > 0");
  }
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> context(ZSTD_createCCtx(),
                                                             ZSTD_freeCCtx);
  if (context == nullptr)
    return absl::ResourceExhaustedError("zstd: no context");
  for (const auto& [parameter, value] :
       {std::pair{ZSTD_c_compressionLevel, options.compression_level},
        std::pair{ZSTD_c_checksumFlag, 1},
        std::pair{ZSTD_c_nbWorkers, options.threads}}) {
    const size_t r = ZSTD_CCtx_setParameter(context.get(), parameter, value);
    // A libzstd built without threads refuses workers: compress on this one.
    if (ZSTD_isError(r) && parameter != ZSTD_c_nbWorkers) {
      return ZstdError(r, "parameter");
    }
  }
  ZSTD_CCtx_setPledgedSrcSize(context.get(), static_cast<uint64_t>(total));
  std::string out;
  out.resize(std::max<size_t>(ZSTD_CStreamOutSize(), total / 64 + 4096));
  size_t out_used = 0;
  std::string block(static_cast<size_t>(std::min(options.block_bytes, total)),
                    '\0');
  int64_t offset = 0;
  while (true) {
    const int64_t size = std::min<int64_t>(options.block_bytes, total - offset);
    ReadParts(updated, offset, block.data(), size);
    XorParts(base, offset, block.data(), size);
    offset += size;
    const ZSTD_EndDirective mode =
        offset == total ? ZSTD_e_end : ZSTD_e_continue;
    ZSTD_inBuffer input{block.data(), static_cast<size_t>(size), 0};
    while (true) {
      if (out.size() - out_used < ZSTD_CStreamOutSize())
        out.resize(out.size() * 2);
      ZSTD_outBuffer output{out.data() + out_used, out.size() - out_used, 0};
      const size_t left =
          ZSTD_compressStream2(context.get(), &output, &input, mode);
      if (ZSTD_isError(left)) return ZstdError(left, "compress");
      out_used += output.pos;
      const bool done =
          mode == ZSTD_e_end ? left == 0 : input.pos == input.size;
      if (done) break;
    }
    if (offset == total) break;
  }
  out.resize(out_used);
  return out;
}

int64_t MaxXorDeltaBytes(int64_t payload_bytes) {
  return static_cast<int64_t>(
      ZSTD_compressBound(static_cast<size_t>(payload_bytes)));
}

struct XorDeltaDecoder::State {
  std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> context{ZSTD_createDCtx(),
                                                             ZSTD_freeDCtx};
  std::string buffer = std::string(ZSTD_DStreamOutSize() * 8, '\0');
};

XorDeltaDecoder::XorDeltaDecoder(PayloadParts base, int64_t total_bytes)
    : base_(std::move(base)),
      total_bytes_(total_bytes),
      state_(std::make_unique<State>()) {}

XorDeltaDecoder::~XorDeltaDecoder() = default;

void XorDeltaDecoder::XorWithBase(char* bytes, size_t size) const {
  XorParts(base_, decoded_, bytes, static_cast<int64_t>(size));
}

absl::Status XorDeltaDecoder::Feed(const char* data, size_t size,
                                   const Sink& sink) {
  if (state_->context == nullptr) {
    return absl::ResourceExhaustedError("zstd: no context");
  }
  ZSTD_inBuffer input{data, size, 0};
  while (input.pos < input.size || !frame_complete_) {
    if (frame_complete_) {
      return FieldError(absl::StatusCode::kDataLoss, "chunk",
                        "bytes after the end of the delta's zstd frame");
    }
    ZSTD_outBuffer output{state_->buffer.data(), state_->buffer.size(), 0};
    const size_t r =
        ZSTD_decompressStream(state_->context.get(), &output, &input);
    if (ZSTD_isError(r)) {
      return FieldError(
          absl::StatusCode::kDataLoss, "chunk",
          absl::StrCat("the delta is not a valid zstd frame "
                       "(after ",
                       decoded_, " rebuilt bytes): ", ZSTD_getErrorName(r)));
    }
    if (decoded_ + static_cast<int64_t>(output.pos) > total_bytes_) {
      return FieldError(
          absl::StatusCode::kDataLoss, "chunk",
          absl::StrCat("the delta rebuilds more than the header's ",
                       total_bytes_, " bytes"));
    }
    if (output.pos > 0) {
      XorWithBase(state_->buffer.data(), output.pos);
      if (absl::Status s = sink(state_->buffer.data(), output.pos); !s.ok()) {
        return s;
      }
      decoded_ += static_cast<int64_t>(output.pos);
    }
    frame_complete_ = r == 0;
    // More input is needed and the output buffer was not filled: wait.
    if (!frame_complete_ && input.pos == input.size &&
        output.pos < output.size) {
      break;
    }
  }
  return absl::OkStatus();
}

absl::Status XorDeltaDecoder::Finish() const {
  if (!frame_complete_ || decoded_ != total_bytes_) {
    return FieldError(
        absl::StatusCode::kDataLoss, "chunk",
        absl::StrCat("the delta ended after rebuilding ", decoded_, " of ",
                     total_bytes_, " bytes",
                     frame_complete_ ? "" : " (its zstd frame is incomplete)"));
  }
  return absl::OkStatus();
}

}  // namespace detlogp::v1
