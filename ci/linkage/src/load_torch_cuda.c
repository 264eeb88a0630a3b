/* Loads libtorch's CUDA half (libtorch_cuda.so) when this process starts on a machine with an
 * NVIDIA driver, from the folder its CPU half (libtorch_cpu.so) was loaded from.
 *
 * Linking libtorch_cuda into every binary (what `--no-as-needed -ltorch_cuda` did) made every
 * process load the whole CUDA stack (cuBLAS, cuDNN, NCCL, ...) and run its static initializers
 * even where no GPU can exist: about 0.2 s and 400 MB more per process on a GPU-less machine,
 * paid by every test process, every exec'd rank and every CLI call. Loaded here, before
 * `main`, CUDA is registered with libtorch exactly as if it had been linked wherever a driver
 * is, so nothing downstream (tch::Cuda, the NCCL backend) can tell the difference.
 *
 * LOCKSTEP_LOAD_CUDA=1 loads it even without a driver (tests prove the load that way);
 * LOCKSTEP_LOAD_CUDA=0 never loads it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int torch_cuda_beside_torch_cpu(struct dl_phdr_info *info, size_t size, void *out) {
    static const char suffix[] = "/libtorch_cpu.so";
    size_t name_len = strlen(info->dlpi_name);
    size_t suffix_len = sizeof(suffix) - 1;
    (void)size;
    if (name_len < suffix_len || strcmp(info->dlpi_name + name_len - suffix_len, suffix) != 0) {
        return 0;
    }
    snprintf((char *)out, PATH_MAX, "%.*s/libtorch_cuda.so", (int)(name_len - suffix_len),
             info->dlpi_name);
    return 1;
}

__attribute__((constructor)) static void lockstep_load_torch_cuda(void) {
    const char *wanted = getenv("LOCKSTEP_LOAD_CUDA");
    char path[PATH_MAX] = {0};
    if (wanted && strcmp(wanted, "0") == 0) {
        return;
    }
    if (!(wanted && strcmp(wanted, "1") == 0) && access("/proc/driver/nvidia/version", F_OK) != 0
        && access("/dev/nvidiactl", F_OK) != 0) {
        return;
    }
    /* A CPU-only libtorch has no CUDA half: nothing to load. */
    if (!dl_iterate_phdr(torch_cuda_beside_torch_cpu, path) || access(path, F_OK) != 0) {
        return;
    }
    if (!dlopen(path, RTLD_NOW | RTLD_GLOBAL)) {
        fprintf(stderr, "lockstep: %s could not be loaded, CUDA is unavailable: %s\n", path,
                dlerror());
    }
}
