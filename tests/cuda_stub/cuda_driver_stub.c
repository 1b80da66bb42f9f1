// A stub CUDA driver, libcuda.so.1: what the pinned wheel dlopens and looks up
// (c10/cuda/driver_api.cpp, ATen's lazy NVRTC stub) when Python's `import torch`
// initializes CUDA over the stub runtime (libcudart.so.13, LD_PRELOAD) for fake CUDA
// tensors (tests/fsdp2_offload_witness_test.py). One device with a primary context that
// is only an address; cuGetProcAddress hands out this library's own functions. Fake
// tensors launch nothing, so the rest of what the wheel may ask for says
// CUDA_ERROR_NOT_SUPPORTED (801). C, without the driver's headers: int is CUresult.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

static char primary_context[64];

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int* version) { *version = 13000; return 0; }
int cuDeviceGetCount(int* count) { *count = 1; return 0; }
int cuDeviceGet(int* device, int ordinal) { *device = ordinal; return 0; }
int cuDeviceGetAttribute(int* value, int attribute, int device) {
  (void)attribute; (void)device; *value = 0; return 0;
}
int cuDevicePrimaryCtxGetState(int device, unsigned* flags, int* active) {
  (void)device; if (flags) *flags = 0; if (active) *active = 1; return 0;
}
int cuDevicePrimaryCtxRetain(void** context, int device) {
  (void)device; *context = primary_context; return 0;
}
int cuCtxGetCurrent(void** context) { *context = primary_context; return 0; }
int cuCtxSetCurrent(void* context) { (void)context; return 0; }
int cuCtxPushCurrent(void* context) { (void)context; return 0; }
int cuCtxPopCurrent(void** context) { if (context) *context = primary_context; return 0; }
int cuGetErrorString(int error, const char** s) { (void)error; *s = "stub"; return 0; }
int cuGetErrorName(int error, const char** s) { (void)error; *s = "stub"; return 0; }

/* This library's own function of that name, or CUDA_ERROR_NOT_FOUND (500). */
static int Lookup(const char* name, void** fn) {
  Dl_info info;
  void* self = NULL;
  if (dladdr((void*)&Lookup, &info) != 0) self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  *fn = self != NULL ? dlsym(self, name) : NULL;
  return *fn != NULL ? 0 : 500;
}
int cuGetProcAddress(const char* name, void** fn, int version, unsigned long long flags,
                     int* status) {
  (void)version; (void)flags; if (status) *status = 0; return Lookup(name, fn);
}
int cuGetProcAddress_v2(const char* name, void** fn, int version, unsigned long long flags,
                        int* status) {
  (void)version; (void)flags; if (status) *status = 0; return Lookup(name, fn);
}

/* Never called with fake tensors. */
int cuCtxFromGreenCtx(void) { return 801; }
int cuDevResourceGenerateDesc(void) { return 801; }
int cuDevSmResourceSplitByCount(void) { return 801; }
int cuDeviceGetDevResource(void) { return 801; }
int cuDeviceGetUuid(void) { return 801; }
int cuFuncGetAttribute(void) { return 801; }
int cuFuncSetAttribute(void) { return 801; }
int cuFuncSetCacheConfig(void) { return 801; }
int cuGreenCtxCreate(void) { return 801; }
int cuGreenCtxDestroy(void) { return 801; }
int cuGreenCtxStreamCreate(void) { return 801; }
int cuKernelGetAttribute(void) { return 801; }
int cuLaunchCooperativeKernel(void) { return 801; }
int cuLaunchKernel(void) { return 801; }
int cuLinkAddData_v2(void) { return 801; }
int cuLinkComplete(void) { return 801; }
int cuLinkCreate_v2(void) { return 801; }
int cuLogsRegisterCallback(void) { return 801; }
int cuLogsUnregisterCallback(void) { return 801; }
int cuMemAddressFree(void) { return 801; }
int cuMemAddressReserve(void) { return 801; }
int cuMemCreate(void) { return 801; }
int cuMemExportToShareableHandle(void) { return 801; }
int cuMemGetAddressRange(void) { return 801; }
int cuMemGetAddressRange_v2(void) { return 801; }
int cuMemGetAllocationGranularity(void) { return 801; }
int cuMemGetAllocationPropertiesFromHandle(void) { return 801; }
int cuMemImportFromShareableHandle(void) { return 801; }
int cuMemMap(void) { return 801; }
int cuMemRelease(void) { return 801; }
int cuMemRetainAllocationHandle(void) { return 801; }
int cuMemSetAccess(void) { return 801; }
int cuMemUnmap(void) { return 801; }
int cuMemsetD32Async(void) { return 801; }
int cuModuleGetFunction(void) { return 801; }
int cuModuleLoad(void) { return 801; }
int cuModuleLoadData(void) { return 801; }
int cuModuleLoadDataEx(void) { return 801; }
int cuModuleUnload(void) { return 801; }
int cuMulticastAddDevice(void) { return 801; }
int cuMulticastBindMem(void) { return 801; }
int cuMulticastCreate(void) { return 801; }
int cuMulticastUnbind(void) { return 801; }
int cuOccupancyMaxActiveBlocksPerMultiprocessor(void) { return 801; }
int cuPointerGetAttribute(void) { return 801; }
int cuStreamGetCtx(void) { return 801; }
int cuStreamWriteValue32(void) { return 801; }
int cuTensorMapEncodeTiled(void) { return 801; }
