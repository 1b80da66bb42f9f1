// A stub libnvidia-ml.so.1, which c10/cuda/driver_api.cpp dlopens: NVML says it works
// and knows of no GPU fabric, so that an expandable segment's pages are mapped without
// fabric handles (c10/cuda/PeerToPeerAccess.cpp, get_fabric_access).
extern "C" {
int nvmlInit_v2() { return 0; }
int nvmlShutdown() { return 0; }
int nvmlDeviceGetHandleByPciBusId_v2(const char*, void** device) { *device = reinterpret_cast<void*>(1); return 0; }
int nvmlDeviceGetGpuFabricInfoV(void*, void*) { return 3; }  // NVML_ERROR_NOT_SUPPORTED
int nvmlDeviceGetNvLinkRemoteDeviceType(void*, unsigned, int*) { return 3; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void*, unsigned, void*) { return 3; }
int nvmlDeviceGetComputeRunningProcesses(void*, unsigned*, void*) { return 3; }
int nvmlSystemGetCudaDriverVersion_v2(int* v) { *v = 13000; return 0; }
}
