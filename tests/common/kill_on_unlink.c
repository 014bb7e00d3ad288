/* A fault injector for tests (LD_PRELOAD): with WEFT_TEST_KILL_ON_UNLINK="N:name,name,..." the
 * process kills itself with SIGKILL at the N-th unlink/unlinkat/remove of a file whose base name
 * is one of the names, as a power cut or kill -9 would stop it in the middle of deleting a
 * directory (N = 2: one of them is gone, whatever order the directory lists them in). Without
 * the variable it only passes the calls on. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int seen = 0;

static void die_if_doomed(const char* path) {
  const char* spec = getenv("WEFT_TEST_KILL_ON_UNLINK");
  if (spec == NULL || path == NULL) return;
  char* names = NULL;
  const long n = strtol(spec, &names, 10);
  if (n <= 0 || *names != ':') return;
  const char* base = strrchr(path, '/');
  base = base != NULL ? base + 1 : path;
  const size_t length = strlen(base);
  for (const char* name = names + 1; *name != '\0';) {
    const char* end = strchr(name, ',');
    const size_t size = end != NULL ? (size_t)(end - name) : strlen(name);
    if (size == length && strncmp(name, base, size) == 0) {
      if (++seen == n) kill(getpid(), SIGKILL);
      return;
    }
    name += size + (end != NULL ? 1 : 0);
  }
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
