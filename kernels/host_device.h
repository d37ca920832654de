// Lets small math headers be shared verbatim by host C++ and CUDA device code.
#ifndef DETLOGP_KERNELS_HOST_DEVICE_H_
#define DETLOGP_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define DETLOGP_HOST_DEVICE __host__ __device__
#else
#define DETLOGP_HOST_DEVICE
#endif

#endif  // DETLOGP_KERNELS_HOST_DEVICE_H_
