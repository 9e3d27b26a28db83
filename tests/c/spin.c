// cflags: -O2 -fomit-frame-pointer
// A hot C function built without frame pointers (the spine test then
// removes its .eh_frame too: neither way to unwind is left).
#include <time.h>
static volatile unsigned long sink;
__attribute__((noinline)) static unsigned long spin(unsigned long x) {
  for (int i = 0; i < 100000; i++) x = x * 6364136223846793005UL + 1442695040888963407UL;
  return x;
}
int main(void) {
  time_t end = time(0) + 2;
  unsigned long x = 1;
  while (time(0) < end) x = spin(x);
  sink = x;
  return 0;
}
