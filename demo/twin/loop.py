"""The per-instance iteration loop around an Engine.

Each turn: step the engine, run the per-iteration `collective` (rank coupling: it
blocks while any peer rank is stopped), wait out the iteration's modelled cost,
then hand the tokens to their requests and the stats to `on_stats`. After the last
request finishes one more (empty) iteration is run, so the stats end at active=0 as
TRT-LLM's do; then the loop sleeps until work arrives. Clock and sleep are
injectable so tests drive it without waiting.
"""
import threading
import time


class EngineLoop:
    def __init__(self, engine, *, collective=None, on_stats=None, on_error=None,
                 sleep=time.sleep, clock=time.monotonic):
        self.engine = engine
        self.collective = collective
        self.on_stats = on_stats
        self.on_error = on_error
        self._sleep = sleep
        self._clock = clock
        self._wake = threading.Condition()
        self._stop = False
        self._final_pending = False
        self._thread = None

    def submit(self, seq):
        """Enqueue (may raise EngineError/QueueFullError) and wake the loop."""
        self.engine.enqueue(seq)
        self.notify()

    def cancel(self, req_id):
        self.engine.cancel(req_id)
        self.notify()

    def notify(self):
        with self._wake:
            self._wake.notify()

    def run_once(self):
        """One iteration; returns the engine's Iteration."""
        t0 = self._clock()
        it = self.engine.step()
        if self.collective is not None:
            self.collective(it)
        left = it.duration_s - (self._clock() - t0)
        if left > 0:
            self._sleep(left)
        for ev in it.events:
            if ev.seq.on_event is not None:
                ev.seq.on_event(ev)
        if self.on_stats is not None:
            self.on_stats(it.stats)
        self._final_pending = it.stats.active > 0
        return it

    def start(self):
        self._thread = threading.Thread(target=self._run, name="twin-engine-loop", daemon=True)
        self._thread.start()

    def stop(self):
        with self._wake:
            self._stop = True
            self._wake.notify()

    def _run(self):
        while True:
            with self._wake:
                while not self._stop and not self._final_pending and not self.engine.has_work():
                    self._wake.wait(0.5)
                if self._stop:
                    return
            try:
                self.run_once()
            except Exception as exc:  # a lost peer rank, a bug: report, keep no iteration half done
                if self.on_error is None:
                    raise
                self.on_error(exc)
