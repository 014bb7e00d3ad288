/* For LD_PRELOAD: starts a thread when the library loads, before main, as some preloaded libraries
 * do (a profiler, an allocator's background thread). The launcher (trainer --nproc) then cannot
 * fork ranks that go on running (a fork copies the locks other threads hold) and must execute the
 * trainer afresh for each. tests/dist/test_launcher.cpp checks that path. */
#include <pthread.h>
#include <unistd.h>

static void* idle(void* unused) {
  (void)unused;
  for (;;) pause();
  return 0;
}

__attribute__((constructor)) static void start_a_thread(void) {
  pthread_t thread;
  if (pthread_create(&thread, 0, idle, 0) == 0) pthread_detach(thread);
}
