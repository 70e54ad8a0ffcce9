//! [`IoPool`]: the store's I/O threads, started once with the store and reused by every
//! batch. Starting threads per batch costs more than a batch of small blocks takes to
//! read from the page cache (hundreds of microseconds for 8 threads on a busy machine).

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

/// A part of one batch, run on a pool thread.
type Job = Box<dyn FnOnce() + Send + 'static>;

/// Threads that run the parts of batches; each caller works on its own batch too, so a
/// batch progresses even while every pool thread serves another store call.
pub(super) struct IoPool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// I/Os of one batch in flight at most (the pool's threads and the caller).
    width: usize,
}

/// How many of a batch's parts have finished, and the first panic among them.
#[derive(Default)]
struct Latch {
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    cv: Condvar,
}

impl Latch {
    fn finish(&self, panicked: Option<Box<dyn Any + Send>>) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.0 += 1;
        if s.1.is_none() {
            s.1 = panicked;
        }
        self.cv.notify_all();
    }

    /// Waits until `parts` have finished; the first panic among them, if any.
    fn wait(&self, parts: usize) -> Option<Box<dyn Any + Send>> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while s.0 < parts {
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.1.take()
    }
}

impl IoPool {
    /// A pool for batches of up to `width` I/Os in flight: `width - 1` threads, the
    /// caller being the last. A thread that cannot be started narrows the pool.
    pub(super) fn new(width: usize) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let threads: Vec<JoinHandle<()>> = (1..width.max(1))
            .filter_map(|i| {
                let rx: Receiver<Job> = rx.clone();
                std::thread::Builder::new()
                    .name(format!("kvoffload-disk-io-{i}"))
                    .spawn(move || {
                        for job in rx {
                            job();
                        }
                    })
                    .map_err(|e| log::warn!("kvoffload disk tier: cannot start I/O thread: {e}"))
                    .ok()
            })
            .collect();
        Self {
            width: threads.len() + 1,
            jobs: Some(tx),
            threads,
        }
    }

    /// Runs `work` on every item, on up to the pool's width at once, the results in the
    /// items' order. Each thread takes the next item not yet taken, so a slow I/O holds
    /// up only itself and the device's queue stays full until the batch's last items. A
    /// panic in `work` is raised here once every part has stopped.
    pub(super) fn run<T: Sync, R: Send>(
        &self,
        items: &[T],
        work: impl Fn(&T) -> R + Sync,
    ) -> Vec<R> {
        let parts = self.width.min(items.len());
        if parts <= 1 {
            return items.iter().map(&work).collect();
        }
        let next = AtomicUsize::new(0);
        let done: Mutex<Vec<(usize, R)>> = Mutex::new(Vec::with_capacity(items.len()));
        let part = || {
            let mut mine = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else {
                    break;
                };
                mine.push((i, work(item)));
            }
            done.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(mine);
        };
        let part: &(dyn Fn() + Sync) = &part;
        // SAFETY: the jobs below are the only users of this extended borrow, and this
        // function does not return (nor unwind: `catch_unwind` on every path) before the
        // latch counts every job sent as finished, which each job reports only after its
        // last use of `part`; the latch itself is shared by `Arc`, so a job's report
        // never touches this frame.
        let part: &'static (dyn Fn() + Sync) = unsafe { std::mem::transmute(part) };
        let latch = Arc::new(Latch::default());
        let mut sent = 0;
        for _ in 1..parts {
            let l = Arc::clone(&latch);
            let job: Job = Box::new(move || {
                let r = panic::catch_unwind(AssertUnwindSafe(part));
                l.finish(r.err());
            });
            match self.jobs.as_ref().map(|tx| tx.send(job)) {
                Some(Ok(())) => sent += 1,
                // No pool thread to take it: the caller's part takes its items.
                _ => break,
            }
        }
        let mine = panic::catch_unwind(AssertUnwindSafe(part)).err();
        let theirs = latch.wait(sent);
        if let Some(p) = mine.or(theirs) {
            panic::resume_unwind(p);
        }
        let mut done = done.into_inner().unwrap_or_else(PoisonError::into_inner);
        done.sort_unstable_by_key(|(i, _)| *i);
        done.into_iter().map(|(_, r)| r).collect()
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        // Closing the queue ends each thread's loop once it is empty.
        self.jobs = None;
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                log::error!("kvoffload disk tier: an I/O thread panicked");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn results_come_in_order_from_every_width() {
        for width in [1, 2, 8] {
            let pool = IoPool::new(width);
            let items: Vec<u32> = (0..100).collect();
            for _ in 0..3 {
                assert_eq!(
                    pool.run(&items, |&i| i * 2),
                    (0..100).map(|i| i * 2).collect::<Vec<_>>()
                );
            }
            assert_eq!(pool.run(&[7u32], |&i| i + 1), [8]);
            assert!(pool.run(&[] as &[u32], |&i| i).is_empty());
        }
    }

    #[test]
    fn a_panic_in_work_reaches_the_caller_after_every_part_stopped() {
        let pool = IoPool::new(4);
        let items: Vec<u32> = (0..64).collect();
        let ran = AtomicUsize::new(0);
        let r = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(&items, |&i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert_ne!(i, 40, "injected");
                i
            })
        }));
        assert!(r.is_err());
        // Every item was taken by some part before the panic was raised here: nothing
        // runs after `run` returned.
        let after = ran.load(Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(ran.load(Ordering::Relaxed), after);
        // The pool still works.
        assert_eq!(pool.run(&items, |&i| i).len(), 64);
    }
}
