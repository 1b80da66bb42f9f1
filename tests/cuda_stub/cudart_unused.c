// The rest of what the pinned wheel's libraries import from libcudart.so.13 (nm -D
// --undefined-only torch/lib/*.so | grep @libcudart), so that Python's `import torch`
// loads over this stub (tests/fsdp2_offload_witness_test.py: FSDP2 on fake CUDA tensors).
// Fake tensors launch no kernel, copy nothing and capture no graph, so none of these is
// called but the fat-binary registrations each CUDA library's constructors make, which
// register nothing here. C, without the runtime's headers: only the names link.

// Registration: a null handle; nothing is registered.
void* __cudaGetKernel(void) { return 0; }
void* __cudaLaunchKernel(void) { return 0; }
void* __cudaPopCallConfiguration(void) { return 0; }
void* __cudaPushCallConfiguration(void) { return 0; }
void* __cudaRegisterFatBinary(void) { return 0; }
void* __cudaRegisterFatBinaryEnd(void) { return 0; }
void* __cudaRegisterFunction(void) { return 0; }
void* __cudaRegisterVar(void) { return 0; }
void* __cudaUnregisterFatBinary(void) { return 0; }

// Never called with fake tensors: cudaErrorNotSupported (801).
int cudaDeviceGetPCIBusId(void) { return 801; }
int cudaFreeHost(void) { return 801; }
int cudaFuncGetAttributes(void) { return 801; }
int cudaFuncSetAttribute(void) { return 801; }
int cudaGetSymbolAddress(void) { return 801; }
int cudaGraphAddNode(void) { return 801; }
int cudaGraphConditionalHandleCreate(void) { return 801; }
int cudaGraphDestroy(void) { return 801; }
int cudaGraphExecDestroy(void) { return 801; }
int cudaGraphGetNodes(void) { return 801; }
int cudaGraphInstantiate(void) { return 801; }
int cudaGraphInstantiateWithFlags(void) { return 801; }
int cudaGraphLaunch(void) { return 801; }
int cudaGraphRetainUserObject(void) { return 801; }
int cudaHostAlloc(void) { return 801; }
int cudaHostRegister(void) { return 801; }
int cudaHostUnregister(void) { return 801; }
int cudaIpcGetEventHandle(void) { return 801; }
int cudaIpcOpenEventHandle(void) { return 801; }
int cudaKernelSetAttributeForDevice(void) { return 801; }
int cudaLaunchCooperativeKernel(void) { return 801; }
int cudaLaunchHostFunc(void) { return 801; }
int cudaLaunchKernelExC(void) { return 801; }
int cudaLibraryGetGlobal(void) { return 801; }
int cudaLibraryGetKernel(void) { return 801; }
int cudaLibraryGetKernelCount(void) { return 801; }
int cudaLibraryGetManaged(void) { return 801; }
int cudaLibraryGetUnifiedFunction(void) { return 801; }
int cudaLibraryLoadData(void) { return 801; }
int cudaLibraryLoadFromFile(void) { return 801; }
int cudaLibraryUnload(void) { return 801; }
int cudaMallocHost(void) { return 801; }
int cudaMallocManaged(void) { return 801; }
int cudaMemcpy2DAsync(void) { return 801; }
int cudaMemcpyToSymbol(void) { return 801; }
int cudaMemset(void) { return 801; }
int cudaMemsetAsync(void) { return 801; }
int cudaOccupancyMaxActiveBlocksPerMultiprocessor(void) { return 801; }
int cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(void) { return 801; }
int cudaProfilerStart(void) { return 801; }
int cudaProfilerStop(void) { return 801; }
int cudaStreamAddCallback(void) { return 801; }
int cudaStreamBeginCapture(void) { return 801; }
int cudaStreamBeginCaptureToGraph(void) { return 801; }
int cudaStreamEndCapture(void) { return 801; }
int cudaStreamGetPriority(void) { return 801; }
int cudaStreamUpdateCaptureDependencies(void) { return 801; }
int cudaUserObjectCreate(void) { return 801; }
int cudaUserObjectRelease(void) { return 801; }
