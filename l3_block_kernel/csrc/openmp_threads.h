// OpenMP's two thread queries, for a CPU kernel built without OpenMP (a compiler without it, or
// a torch on another OpenMP: kernel_build.py): the calling thread then does every item alone.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#else
inline int omp_get_thread_num() { return 0; }
inline int omp_get_num_threads() { return 1; }
#endif
