// The CUDA kernel choice and the portable kernel's determinism-key wording
// (kernels/cuda/kernel_kind.h, server/backends/cuda_device_selection.h):
// pure functions, tested without a GPU.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/kernel_kind.h"
#include "server/backends/backend.h"
#include "server/backends/cuda_device_selection.h"

namespace detlogp {
namespace {

using kernels::cuda::BestShippedSass;
using kernels::cuda::DefaultKernelFor;
using kernels::cuda::KernelKind;
using kernels::cuda::kPortableSassArchs;
using kernels::cuda::PortableInstructionSet;
using server::GpuInfo;
using server::LogpKernelChoice;
using server::SelectGpus;

TEST(DefaultKernelFor, HopperOnNinePointZeroPortableElsewhere) {
  EXPECT_EQ(*DefaultKernelFor(9, 0), KernelKind::kHopper);
  for (auto [major, minor] : std::vector<std::pair<int, int>>{
           {8, 0}, {8, 6}, {8, 7}, {8, 9}, {10, 0}, {12, 0}}) {
    EXPECT_EQ(*DefaultKernelFor(major, minor), KernelKind::kPortable)
        << major << "." << minor;
  }
  EXPECT_EQ(DefaultKernelFor(7, 5).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(PortableInstructionSet, NamesTheLoadedCubin) {
  EXPECT_EQ(PortableInstructionSet(9, 0, 90, 90, 13000, kPortableSassArchs),
            "sm_90/sass_sm_90");
  EXPECT_EQ(PortableInstructionSet(8, 6, 86, 86, 13000, kPortableSassArchs),
            "sm_86/sass_sm_86");
  // sm_80 SASS runs on an sm_87 (Orin): the key says which cubin ran, and
  // no driver version (no JIT).
  EXPECT_EQ(PortableInstructionSet(8, 7, 80, 80, 13000, kPortableSassArchs),
            "sm_87/sass_sm_80");
  EXPECT_NE(PortableInstructionSet(8, 9, 89, 89, 13000, kPortableSassArchs),
            PortableInstructionSet(8, 9, 80, 80, 13000, kPortableSassArchs));
}

TEST(PortableInstructionSet, JitNamesPtxAndDriver) {
  const std::string b200 =
      PortableInstructionSet(10, 0, 100, 80, 13000, kPortableSassArchs);
  EXPECT_EQ(b200, "sm_100/jit_compute_80/driver_13000");
  EXPECT_EQ(PortableInstructionSet(12, 0, 120, 80, 13010, kPortableSassArchs),
            "sm_120/jit_compute_80/driver_13010");
  // A different driver may JIT different code: a different key.
  EXPECT_NE(b200,
            PortableInstructionSet(10, 0, 100, 80, 13020, kPortableSassArchs));
}

TEST(BestShippedSass, SameMajorNotNewer) {
  EXPECT_EQ(BestShippedSass(8, 0, kPortableSassArchs), 80);
  EXPECT_EQ(BestShippedSass(8, 7, kPortableSassArchs), 86);
  EXPECT_EQ(BestShippedSass(8, 9, kPortableSassArchs), 89);
  EXPECT_EQ(BestShippedSass(9, 0, kPortableSassArchs), 90);
  EXPECT_EQ(BestShippedSass(10, 0, kPortableSassArchs), 0);
  EXPECT_EQ(BestShippedSass(12, 0, kPortableSassArchs), 0);
}

TEST(ParseLogpKernelChoice, ValuesAndError) {
  EXPECT_EQ(*server::ParseLogpKernelChoice(""), LogpKernelChoice::kAuto);
  EXPECT_EQ(*server::ParseLogpKernelChoice("auto"), LogpKernelChoice::kAuto);
  EXPECT_EQ(*server::ParseLogpKernelChoice("hopper"),
            LogpKernelChoice::kHopper);
  EXPECT_EQ(*server::ParseLogpKernelChoice("portable"),
            LogpKernelChoice::kPortable);
  auto bad = server::ParseLogpKernelChoice("wgmma");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--logp_kernel=wgmma"),
            std::string::npos);
}

const GpuInfo kH200a{0, "NVIDIA H200", 9, 0};
const GpuInfo kH200b{1, "NVIDIA H200", 9, 0};
const GpuInfo kA100{2, "NVIDIA A100-SXM4-80GB", 8, 0};
const GpuInfo kL40S{3, "NVIDIA L40S", 8, 9};
const GpuInfo kT4{4, "Tesla T4", 7, 5};

// Device lists whose indices match their positions.
std::vector<GpuInfo> Gpus(std::vector<GpuInfo> gpus) {
  for (size_t i = 0; i < gpus.size(); ++i) gpus[i].index = static_cast<int>(i);
  return gpus;
}

TEST(SelectGpus, AutoPicksTheKernelByComputeCapability) {
  auto h200 = SelectGpus(Gpus({kH200a}), server::kFirstSuitableDevice, false,
                         LogpKernelChoice::kAuto);
  ASSERT_TRUE(h200.ok()) << h200.status();
  EXPECT_EQ(h200->kernel, KernelKind::kHopper);
  auto a100 = SelectGpus(Gpus({kA100}), server::kFirstSuitableDevice, false,
                         LogpKernelChoice::kAuto);
  ASSERT_TRUE(a100.ok()) << a100.status();
  EXPECT_EQ(a100->kernel, KernelKind::kPortable);
  // A pre-Ampere GPU is skipped, the next one used.
  auto t4_l40s = SelectGpus(Gpus({kT4, kL40S}), server::kFirstSuitableDevice,
                            false, LogpKernelChoice::kAuto);
  ASSERT_TRUE(t4_l40s.ok()) << t4_l40s.status();
  EXPECT_EQ(t4_l40s->devices, std::vector<int>({1}));
  EXPECT_EQ(t4_l40s->kernel, KernelKind::kPortable);
  auto t4 = SelectGpus(Gpus({kT4}), server::kFirstSuitableDevice, false,
                       LogpKernelChoice::kAuto);
  EXPECT_EQ(t4.status().code(), absl::StatusCode::kUnavailable);
}

TEST(SelectGpus, FlagForcesTheKernel) {
  auto portable =
      SelectGpus(Gpus({kH200a}), 0, false, LogpKernelChoice::kPortable);
  ASSERT_TRUE(portable.ok()) << portable.status();
  EXPECT_EQ(portable->kernel, KernelKind::kPortable);
  auto hopper_on_a100 =
      SelectGpus(Gpus({kA100}), 0, false, LogpKernelChoice::kHopper);
  EXPECT_EQ(hopper_on_a100.status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(hopper_on_a100.status().message().find("--logp_kernel=hopper"),
            std::string::npos);
  // "auto" device with hopper forced: no suitable GPU, the message names
  // the flag.
  auto hopper_auto = SelectGpus(Gpus({kA100}), server::kFirstSuitableDevice,
                                false, LogpKernelChoice::kHopper);
  EXPECT_EQ(hopper_auto.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(hopper_auto.status().message().find("--logp_kernel=hopper"),
            std::string::npos);
  auto out_of_range =
      SelectGpus(Gpus({kA100}), 3, false, LogpKernelChoice::kAuto);
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SelectGpus, AllReplicatedKeepsTheFirstKindOnly) {
  auto all = SelectGpus(Gpus({kT4, kH200a, kA100, kH200b}), server::kAllDevices,
                        false, LogpKernelChoice::kAuto);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->devices, std::vector<int>({1, 3}));
  EXPECT_EQ(all->kernel, KernelKind::kHopper);
  ASSERT_EQ(all->left_out.size(), 1u);
  EXPECT_NE(all->left_out[0].find("cuda:2"), std::string::npos);
  // Forced portable: the H200s still are one kind, the A100 another.
  auto portable = SelectGpus(Gpus({kA100, kH200a, kH200b}), server::kAllDevices,
                             false, LogpKernelChoice::kPortable);
  ASSERT_TRUE(portable.ok()) << portable.status();
  EXPECT_EQ(portable->devices, std::vector<int>({0}));
  EXPECT_EQ(portable->kernel, KernelKind::kPortable);
}

TEST(SelectGpus, SameComputeCapabilityDifferentNameIsAnotherKind) {
  const GpuInfo a100_40{1, "NVIDIA A100-SXM4-40GB", 8, 0};
  auto all = SelectGpus(Gpus({kA100, a100_40}), server::kAllDevices, false,
                        LogpKernelChoice::kAuto);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->devices, std::vector<int>({0}));
}

TEST(SelectGpus, VocabParallelRefusesMixedKinds) {
  auto mixed = SelectGpus(Gpus({kH200a, kA100}), server::kAllDevices, true,
                          LogpKernelChoice::kAuto);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(mixed.status().message().find("--vocab_parallel"),
            std::string::npos);
  auto same = SelectGpus(Gpus({kH200a, kH200b}), server::kAllDevices, true,
                         LogpKernelChoice::kPortable);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->devices, std::vector<int>({0, 1}));
  EXPECT_EQ(same->kernel, KernelKind::kPortable);
  // Forced hopper: the A100 is not suitable, so it is no second kind.
  auto hopper = SelectGpus(Gpus({kH200a, kA100, kH200b}), server::kAllDevices,
                           true, LogpKernelChoice::kHopper);
  ASSERT_TRUE(hopper.ok()) << hopper.status();
  EXPECT_EQ(hopper->devices, std::vector<int>({0, 2}));
}

}  // namespace
}  // namespace detlogp
