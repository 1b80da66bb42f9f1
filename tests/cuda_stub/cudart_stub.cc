// A stub libcudart.so.13: the CUDA runtime functions the pinned wheel's libc10_cuda.so
// calls (nm -D --undefined-only libc10_cuda.so | grep @libcudart), with the real
// signatures (the wheel's nvidia/cu13/include/cuda_runtime_api.h) and the same version
// node (cudart.map), so that //tests:cuda_allocator_test drives PyTorch's own CUDA
// caching allocator without a GPU. One 80 GiB sm90 device; cudaMalloc hands out
// increasing fake addresses, never touched; events and streams succeed at once and no
// stream is ever capturing. What the native allocator on one stream never calls (IPC,
// memory pools, graphs, copies to the host) says cudaErrorNotSupported; cudart_unused.c names the
// rest of what the wheel imports, so that Python's `import torch` loads over it too. The driver functions of
// expandable segments (cuMemAddressReserve, cuMemCreate, cuMemMap, ...) come through
// cudaGetDriverEntryPointByVersion, as c10/cuda/driver_api.cpp asks for them.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <map>

namespace {
uintptr_t next_address = uintptr_t{1} << 40;
size_t in_use = 0;
std::map<uintptr_t, size_t>* sizes = new std::map<uintptr_t, size_t>();
constexpr size_t kTotal = size_t{80} << 30;
}  // namespace

// The driver API, for expandable segments (c10/cuda/driver_api.h's required list),
// handed out by cudaGetDriverEntryPointByVersion: virtual ranges and physical handles
// that are only numbers.
namespace {
uintptr_t next_va = uintptr_t{1} << 44;
unsigned long long next_handle = 1;
CUresult StubDeviceGet(CUdevice* d, int) { *d = 0; return CUDA_SUCCESS; }
CUresult StubDeviceGetAttribute(int* v, CUdevice_attribute, CUdevice) { *v = 0; return CUDA_SUCCESS; }
CUresult StubMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr p) { if (base) *base = p; if (size) *size = 0; return CUDA_SUCCESS; }
CUresult StubMemAddressReserve(CUdeviceptr* p, size_t size, size_t, CUdeviceptr, unsigned long long) {
  *p = next_va; next_va += (size + (size_t{1} << 21) - 1) / (size_t{1} << 21) * (size_t{1} << 21); return CUDA_SUCCESS; }
CUresult StubMemAddressFree(CUdeviceptr, size_t) { return CUDA_SUCCESS; }
CUresult StubMemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp*, unsigned long long) {
  if (size > kTotal - in_use) return CUDA_ERROR_OUT_OF_MEMORY;
  in_use += size; *h = next_handle++; (*sizes)[*h] = size; return CUDA_SUCCESS; }
CUresult StubMemRelease(CUmemGenericAllocationHandle h) {
  auto it = sizes->find(h); if (it != sizes->end()) { in_use -= it->second; sizes->erase(it); } return CUDA_SUCCESS; }
CUresult StubMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) { return CUDA_SUCCESS; }
CUresult StubMemUnmap(CUdeviceptr, size_t) { return CUDA_SUCCESS; }
CUresult StubMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) { return CUDA_SUCCESS; }
CUresult StubMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) { *g = size_t{1} << 21; return CUDA_SUCCESS; }
CUresult StubNotSupported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult StubGetErrorString(CUresult, const char** s) { *s = "stub"; return CUDA_SUCCESS; }
struct Entry { const char* name; void* fn; };
const Entry kDriver[] = {
    {"cuDeviceGet", reinterpret_cast<void*>(&StubDeviceGet)},
    {"cuDeviceGetAttribute", reinterpret_cast<void*>(&StubDeviceGetAttribute)},
    {"cuMemGetAddressRange", reinterpret_cast<void*>(&StubMemGetAddressRange)},
    {"cuMemAddressReserve", reinterpret_cast<void*>(&StubMemAddressReserve)},
    {"cuMemRelease", reinterpret_cast<void*>(&StubMemRelease)},
    {"cuMemMap", reinterpret_cast<void*>(&StubMemMap)},
    {"cuMemAddressFree", reinterpret_cast<void*>(&StubMemAddressFree)},
    {"cuMemSetAccess", reinterpret_cast<void*>(&StubMemSetAccess)},
    {"cuMemUnmap", reinterpret_cast<void*>(&StubMemUnmap)},
    {"cuMemCreate", reinterpret_cast<void*>(&StubMemCreate)},
    {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&StubMemGetAllocationGranularity)},
    {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&StubNotSupported)},
    {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&StubNotSupported)},
    {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&StubNotSupported)},
    {"cuMemGetAllocationPropertiesFromHandle", reinterpret_cast<void*>(&StubNotSupported)},
    {"cuMemsetD32Async", reinterpret_cast<void*>(&StubNotSupported)},
    {"cuStreamWriteValue32", reinterpret_cast<void*>(&StubNotSupported)},
    {"cuGetErrorString", reinterpret_cast<void*>(&StubGetErrorString)},
};
}  // namespace

extern "C" {
cudaError_t cudaGetDeviceCount(int* count) { *count = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int* device) { *device = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (size > kTotal - in_use) return cudaErrorMemoryAllocation;
  *ptr = reinterpret_cast<void*>(next_address);
  (*sizes)[next_address] = size;
  next_address += (size + 4095) / 4096 * 4096;
  in_use += size;
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  auto it = sizes->find(reinterpret_cast<uintptr_t>(ptr));
  if (it != sizes->end()) {
    in_use -= it->second;
    sizes->erase(it);
  }
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) { *total = kTotal; *free_bytes = kTotal - in_use; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  std::memset(prop, 0, sizeof(*prop));
  std::strcpy(prop->name, "memledger stub");
  prop->totalGlobalMem = kTotal; prop->major = 9; prop->minor = 0; prop->multiProcessorCount = 132;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int* v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 0; return cudaSuccess; }
// Every pointer is the device's (torch asks when it meets a pointer it did not allocate).
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::memset(a, 0, sizeof(*a));
  a->type = cudaMemoryTypeDevice;
  a->devicePointer = const_cast<void*>(p);
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t) { return "stub"; }
const char* cudaGetErrorString(cudaError_t) { return "stub"; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) { *can = 0; return cudaSuccess; }
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned int) { return cudaSuccess; }
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) { if (least) *least = 0; if (greatest) *greatest = -5; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) { static int n; *e = reinterpret_cast<cudaEvent_t>(uintptr_t{0x1000} + (++n)); return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) { *ms = 0; return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventRecordWithFlags(cudaEvent_t, cudaStream_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* s) { *s = cudaStreamCaptureStatusNone; return cudaSuccess; }
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode*) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) { static int n; *s = reinterpret_cast<cudaStream_t>(uintptr_t{0x3000} + (++n)); return cudaSuccess; }
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int) { static int n; *s = reinterpret_cast<cudaStream_t>(uintptr_t{0x2000} + (++n)); return cudaSuccess; }
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long, cudaDriverEntryPointQueryResult* status) {
  for (const Entry& e : kDriver) {
    if (std::strcmp(e.name, symbol) == 0) {
      *fn = e.fn;
      if (status) *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  }
  *fn = nullptr;
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaErrorSymbolNotFound;
}
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t, cudaStreamCaptureStatus* s, unsigned long long* id, cudaGraph_t* graph, const cudaGraphNode_t** deps, const cudaGraphEdgeData** edges, size_t* n) {
  *s = cudaStreamCaptureStatusNone;
  if (id) *id = 0;
  if (graph) *graph = nullptr;
  if (deps) *deps = nullptr;
  if (edges) *edges = nullptr;
  if (n) *n = 0;
  return cudaSuccess;
}
// Never called by the native allocator on one stream without graphs or IPC: refused.
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t*, int) { return cudaErrorNotSupported; }
cudaError_t cudaDeviceGetGraphMemAttribute(int, cudaGraphMemAttributeType, void*) { return cudaErrorNotSupported; }
cudaError_t cudaDeviceSetGraphMemAttribute(int, cudaGraphMemAttributeType, void*) { return cudaErrorNotSupported; }
cudaError_t cudaFreeAsync(void*, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t cudaGraphNodeGetDependencies(cudaGraphNode_t, cudaGraphNode_t*, cudaGraphEdgeData*, size_t*) { return cudaErrorNotSupported; }
cudaError_t cudaIpcCloseMemHandle(void*) { return cudaErrorNotSupported; }
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t*, void*) { return cudaErrorNotSupported; }
cudaError_t cudaIpcOpenMemHandle(void**, cudaIpcMemHandle_t, unsigned int) { return cudaErrorNotSupported; }
cudaError_t cudaMallocAsync(void**, size_t, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) { return cudaErrorNotSupported; }
cudaError_t cudaMemPoolSetAccess(cudaMemPool_t, const cudaMemAccessDesc*, size_t) { return cudaErrorNotSupported; }
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) { return cudaErrorNotSupported; }
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t) { return cudaErrorNotSupported; }
// Fake tensors' constants (a torch.tensor(x) made under a CUDA default device: Gemma 3's
// embed_scale, a sliding window's size) are real device tensors that FakeTensorMode
// copies and clones: a copy to or within the device, and a kernel, do nothing and
// succeed. Nothing is ever read back: a copy to the host is refused.
cudaError_t cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind kind) {
  return kind == cudaMemcpyDeviceToHost ? cudaErrorNotSupported : cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind kind, cudaStream_t) {
  return kind == cudaMemcpyDeviceToHost ? cudaErrorNotSupported : cudaSuccess;
}
cudaError_t cudaLaunchKernel(const void*, dim3, dim3, void**, size_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaMemcpyPeerAsync(void*, int, const void*, int, size_t, cudaStream_t) { return cudaErrorNotSupported; }
}
