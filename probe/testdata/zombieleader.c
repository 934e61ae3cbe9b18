// zombieleader: the main thread exits (pthread_exit) while a second
// thread keeps running, spinning for a few milliseconds at a time. Its
// process's /proc/PID/stat then shows a zombie leader (state Z).
#include <pthread.h>
#include <time.h>

static void *spin(void *arg) {
	(void)arg;
	for (;;) {
		struct timespec t0, t;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		do {
			clock_gettime(CLOCK_MONOTONIC, &t);
		} while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 2000000L);
		struct timespec nap = {0, 2000000L};
		nanosleep(&nap, 0);
	}
	return 0;
}

int main(void) {
	pthread_t th;
	pthread_create(&th, 0, spin, 0);
	pthread_exit(0);
}
