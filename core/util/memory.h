// Tensor memory accounting: a CPU allocator that wraps LibTorch's (same alignment, same
// malloc) and counts live and peak bytes, so the trainer can report what a step's activations
// cost on each rank (a pipeline stage holding M micro-batches versus 1F1B's at most S). It keeps
// freed blocks of 1 MiB and more for the next allocation of the same size (the next step's), as
// long as the live and kept bytes together stay within 256 MiB above the most live bytes so far.
#pragma once

#include <cstdint>

namespace weft {

// Installs the counting allocator as LibTorch's CPU allocator (idempotent). Tensors allocated
// before are freed by their own allocator and never counted. With glibc, also sets malloc's mmap
// threshold to 4 MiB and its trim threshold to 64 MiB (unless MALLOC_MMAP_THRESHOLD_ /
// MALLOC_TRIM_THRESHOLD_ set them): large blocks return to the system when freed, while the
// heap keeps the small ones a step frees for the next step's.
void install_memory_tracker();
bool memory_tracker_installed();

// Bytes of CPU tensor memory allocated through the tracker and not yet freed.
int64_t tensor_bytes_live();
// The most live bytes since the last reset_tensor_peak() (or since installation).
int64_t tensor_bytes_peak();
// Starts a new peak window at the current live bytes.
void reset_tensor_peak();
// The most live bytes since installation (never reset): what the kept blocks are bounded by.
int64_t tensor_bytes_high_water();
// Bytes of freed blocks kept for reuse (resident, not live).
int64_t tensor_bytes_cached();

}  // namespace weft
