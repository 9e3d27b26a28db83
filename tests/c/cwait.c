// cflags: -O2 -fomit-frame-pointer -pthread
// A thread (`cwaiter`) that waits in glibc's pthread_cond_timedwait from its
// own function, `c_waiting_function`, for 3 s in 20 ms waits. Neither this
// program nor glibc has frame pointers: only CFI unwinds it.
#define _GNU_SOURCE
#include <pthread.h>
#include <time.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
__attribute__((noinline)) void c_waiting_function(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += 20000000;
  if (ts.tv_nsec >= 1000000000) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000;
  }
  pthread_mutex_lock(&m);
  pthread_cond_timedwait(&c, &m, &ts);
  pthread_mutex_unlock(&m);
}
static void *waiter(void *a) {
  time_t end = time(0) + 3;
  while (time(0) < end) c_waiting_function();
  return a;
}
int main(void) {
  pthread_t t;
  pthread_create(&t, 0, waiter, 0);
  pthread_setname_np(t, "cwaiter");
  pthread_join(t, 0);
  return 0;
}
