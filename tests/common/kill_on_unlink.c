/* A fault injector for tests (LD_PRELOAD): the process kills itself with SIGKILL at the first
 * unlink/unlinkat/remove of a path containing $WEFT_TEST_KILL_ON_UNLINK, as a power cut or
 * kill -9 would stop it in the middle of deleting a directory. Without the variable it only
 * passes the calls on. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void die_if_doomed(const char* path) {
  const char* watched = getenv("WEFT_TEST_KILL_ON_UNLINK");
  if (watched != NULL && *watched != '\0' && path != NULL && strstr(path, watched) != NULL) kill(getpid(), SIGKILL);
}

int unlink(const char* path) {
  die_if_doomed(path);
  return ((int (*)(const char*))dlsym(RTLD_NEXT, "unlink"))(path);
}

int unlinkat(int dir, const char* path, int flags) {
  die_if_doomed(path);
  return ((int (*)(int, const char*, int))dlsym(RTLD_NEXT, "unlinkat"))(dir, path, flags);
}

int remove(const char* path) {
  die_if_doomed(path);
  return ((int (*)(const char*))dlsym(RTLD_NEXT, "remove"))(path);
}
