//! Fault injection: a [`CopyBackend`] wrapper that fails chosen copies and delays
//! completions, so the no-hang and no-wrong-KV guarantees can be tested end to end.
//!
//! Off unless a [`FaultPlan`] is given (config key `kvoffload.faults` or the environment
//! variable `KVOFFLOAD_FAULTS`), e.g. `fail_loads_every=3,delay_ms=5`.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use super::{BackendError, CopyBackend, CopyRun, Direction, Ticket};
use crate::config::KEY_FAULTS;
use crate::error::ConfigError;

/// Which copies fail and how long completions are held back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultPlan {
    /// Fail every n-th load job (0: never).
    pub fail_loads_every: u32,
    /// Fail every n-th store job (0: never).
    pub fail_stores_every: u32,
    /// The n-th job fails with a fatal (sticky) device error (0: never).
    pub fatal_after: u32,
    /// Every job takes this long: its bytes land, and it completes, no sooner than this
    /// after its submission (a slow device, not merely a late report).
    pub delay: Duration,
    /// Every n-th disk-tier write fails with `ENOSPC` (0: never). The disk counts I/Os:
    /// a run of blocks in consecutive slots is one, and its error fails every block of it.
    pub disk_enospc_every: u32,
    /// Every n-th disk-tier write fails with `EIO` (0: never).
    pub disk_write_eio_every: u32,
    /// Every n-th disk-tier read fails with `EIO` (0: never).
    pub disk_read_eio_every: u32,
    /// Every n-th disk-tier read returns fewer bytes than asked (0: never).
    pub disk_short_read_every: u32,
    /// Every n-th disk-tier read has one byte flipped, as a bad sector would (0: never):
    /// the byte in the middle of what the I/O read, so one block of a run.
    pub disk_corrupt_read_every: u32,
}

/// A fault spec that does not parse; the message names the bad item.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid fault spec item `{item}`: {reason}")]
pub struct FaultSpecError {
    /// The offending `key=value` item.
    pub item: String,
    /// Why it is rejected.
    pub reason: &'static str,
}

impl FaultPlan {
    /// Parses `key=value` items separated by commas: `fail_loads_every`,
    /// `fail_stores_every`, `fatal_after` (counts) and `delay_ms` for copies;
    /// `disk_enospc_every`, `disk_write_eio_every`, `disk_read_eio_every`,
    /// `disk_short_read_every` and `disk_corrupt_read_every` (counts) for the disk tier.
    ///
    /// # Examples
    /// ```
    /// use offload_core::transfer::FaultPlan;
    ///
    /// let plan = FaultPlan::parse("fail_loads_every=2, delay_ms=5").unwrap();
    /// assert_eq!(plan.fail_loads_every, 2);
    /// assert_eq!(plan.delay.as_millis(), 5);
    /// assert!(FaultPlan::parse("fail_everything=1").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<Self, FaultSpecError> {
        let mut plan = Self::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let err = |reason| FaultSpecError {
                item: item.to_string(),
                reason,
            };
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| err("expected key=value"))?;
            let n: u32 = value
                .trim()
                .parse()
                .map_err(|_| err("value must be a non-negative integer"))?;
            match key.trim() {
                "fail_loads_every" => plan.fail_loads_every = n,
                "fail_stores_every" => plan.fail_stores_every = n,
                "fatal_after" => plan.fatal_after = n,
                "delay_ms" => plan.delay = Duration::from_millis(u64::from(n)),
                "disk_enospc_every" => plan.disk_enospc_every = n,
                "disk_write_eio_every" => plan.disk_write_eio_every = n,
                "disk_read_eio_every" => plan.disk_read_eio_every = n,
                "disk_short_read_every" => plan.disk_short_read_every = n,
                "disk_corrupt_read_every" => plan.disk_corrupt_read_every = n,
                _ => return Err(err("unknown key")),
            }
        }
        Ok(plan)
    }

    /// Parses the value of the config key [`KEY_FAULTS`] (kept raw by
    /// [`OffloadConfig::faults`](crate::OffloadConfig::faults)); the error names the key and
    /// the value.
    ///
    /// ```
    /// use offload_core::transfer::FaultPlan;
    ///
    /// assert_eq!(FaultPlan::from_config_value("fatal_after=4")?.fatal_after, 4);
    /// let err = FaultPlan::from_config_value("explode=1").unwrap_err().to_string();
    /// assert!(err.contains("kvoffload.faults") && err.contains("explode=1"), "{err}");
    /// # Ok::<(), offload_core::ConfigError>(())
    /// ```
    pub fn from_config_value(spec: &str) -> Result<Self, ConfigError> {
        Self::parse(spec).map_err(|e| ConfigError::InvalidValue {
            key: KEY_FAULTS.to_string(),
            value: format!("{spec:?} ({e})"),
            reason: "expected comma-separated key=value items (see FaultPlan::parse)",
        })
    }

    /// Whether the plan injects anything into copies.
    pub fn is_active(&self) -> bool {
        self.fail_loads_every != 0
            || self.fail_stores_every != 0
            || self.fatal_after != 0
            || !self.delay.is_zero()
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fail_loads_every={},fail_stores_every={},fatal_after={},delay_ms={},\
             disk_enospc_every={},disk_write_eio_every={},disk_read_eio_every={},\
             disk_short_read_every={},disk_corrupt_read_every={}",
            self.fail_loads_every,
            self.fail_stores_every,
            self.fatal_after,
            self.delay.as_millis(),
            self.disk_enospc_every,
            self.disk_write_eio_every,
            self.disk_read_eio_every,
            self.disk_short_read_every,
            self.disk_corrupt_read_every
        )
    }
}

/// A job of a delayed plan: held back until its delay passed, then on the inner backend.
#[derive(Debug)]
enum Delayed {
    Waiting {
        since: Instant,
        direction: Direction,
        runs: Vec<CopyRun>,
    },
    Started(Ticket),
}

/// Wraps a backend and injects the faults of a [`FaultPlan`].
#[derive(Debug)]
pub struct FaultInjector<B> {
    inner: B,
    plan: FaultPlan,
    loads: u32,
    stores: u32,
    jobs: u32,
    next_ticket: u64,
    delayed: HashMap<u64, Delayed>,
}

impl<B: CopyBackend> FaultInjector<B> {
    /// Injects `plan`'s faults into `inner`.
    pub fn new(inner: B, plan: FaultPlan) -> Self {
        Self {
            inner,
            plan,
            loads: 0,
            stores: 0,
            jobs: 0,
            next_ticket: 0,
            delayed: HashMap::new(),
        }
    }
}

/// Whether the `count`-th operation (from 1) is one of every `every` to fail; `0`: none.
pub(crate) fn hits(count: u32, every: u32) -> bool {
    every != 0 && count % every == 0
}

impl<B: CopyBackend> CopyBackend for FaultInjector<B> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn attach(&mut self, host_base: u64, host_len: usize) -> Result<(), BackendError> {
        self.inner.attach(host_base, host_len)
    }

    fn wait_event(&mut self, event: u64) -> Result<(), BackendError> {
        self.inner.wait_event(event)
    }

    fn describe(&self) -> String {
        format!(
            "{} with injected faults ({})",
            self.inner.describe(),
            self.plan
        )
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        self.jobs += 1;
        if self.plan.fatal_after != 0 && self.jobs >= self.plan.fatal_after {
            return Err(BackendError::fatal(format!(
                "injected fatal device fault at job #{}",
                self.jobs
            )));
        }
        let (count, every) = match direction {
            Direction::Load => {
                self.loads += 1;
                (self.loads, self.plan.fail_loads_every)
            }
            Direction::Store => {
                self.stores += 1;
                (self.stores, self.plan.fail_stores_every)
            }
        };
        if hits(count, every) {
            return Err(BackendError::job(format!(
                "injected fault: {direction} #{count}"
            )));
        }
        if self.plan.delay.is_zero() {
            // SAFETY: the caller's contract is forwarded unchanged.
            return unsafe { self.inner.submit(direction, runs) };
        }
        // The copy itself is held back, so a test that gives up on a slow job sees its bytes
        // land late, as they would from a slow device.
        self.next_ticket += 1;
        self.delayed.insert(
            self.next_ticket,
            Delayed::Waiting {
                since: Instant::now(),
                direction,
                runs: runs.to_vec(),
            },
        );
        Ok(Ticket(self.next_ticket))
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        if self.plan.delay.is_zero() {
            return self.inner.query(ticket);
        }
        let inner = match self.delayed.get(&ticket.0) {
            None => return Err(BackendError::job(format!("unknown ticket {}", ticket.0))),
            Some(Delayed::Waiting { since, .. }) if since.elapsed() < self.plan.delay => {
                return Ok(false)
            }
            Some(Delayed::Started(inner)) => *inner,
            Some(Delayed::Waiting {
                direction, runs, ..
            }) => {
                // SAFETY: `submit`'s caller keeps every run valid, and its destination
                // untouched, until this ticket is reported done or failed, which has not
                // happened yet.
                let started = unsafe { self.inner.submit(*direction, runs) };
                match started {
                    Ok(inner) => {
                        self.delayed.insert(ticket.0, Delayed::Started(inner));
                        inner
                    }
                    Err(err) => {
                        self.delayed.remove(&ticket.0);
                        return Err(err);
                    }
                }
            }
        };
        let done = self.inner.query(inner);
        if !matches!(done, Ok(false)) {
            self.delayed.remove(&ticket.0);
        }
        done
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::transfer::HostCopyBackend;

    #[test]
    fn parse_round_trips_and_rejects_bad_items() {
        let plan =
            FaultPlan::parse("fail_loads_every=3,fail_stores_every=4,fatal_after=9,delay_ms=7")
                .unwrap();
        assert_eq!(FaultPlan::parse(&plan.to_string()).unwrap(), plan);
        assert!(plan.is_active());
        assert!(!FaultPlan::parse("").unwrap().is_active());
        for bad in ["delay_ms", "delay_ms=-1", "nope=1", "fail_loads_every=x"] {
            let e = FaultPlan::parse(bad).unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn every_nth_job_of_a_direction_fails() {
        let plan = FaultPlan {
            fail_loads_every: 2,
            ..FaultPlan::default()
        };
        let mut b = FaultInjector::new(HostCopyBackend::new(), plan);
        // SAFETY: no runs, nothing is copied.
        let outcomes: Vec<bool> = (0..4)
            .map(|_| unsafe { b.submit(Direction::Load, &[]) }.is_ok())
            .collect();
        assert_eq!(outcomes, vec![true, false, true, false]);
        // SAFETY: as above.
        assert!(unsafe { b.submit(Direction::Store, &[]) }.is_ok());
    }

    #[test]
    fn fatal_fault_is_fatal_and_delays_hold_completions() {
        let plan = FaultPlan {
            fatal_after: 2,
            delay: Duration::from_millis(30),
            ..FaultPlan::default()
        };
        let mut b = FaultInjector::new(HostCopyBackend::new(), plan);
        // SAFETY: no runs, nothing is copied.
        let t = unsafe { b.submit(Direction::Store, &[]) }.unwrap();
        assert!(!b.query(t).unwrap());
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.query(t).unwrap());
        // SAFETY: as above.
        let e = unsafe { b.submit(Direction::Store, &[]) }.unwrap_err();
        assert!(e.is_fatal());
    }

    #[test]
    fn a_delayed_copy_lands_only_when_it_completes() {
        let plan = FaultPlan {
            delay: Duration::from_millis(50),
            ..FaultPlan::default()
        };
        let mut b = FaultInjector::new(HostCopyBackend::new(), plan);
        let src = [9u8; 16];
        let mut dst = vec![0u8; 16];
        let run = CopyRun {
            src: src.as_ptr() as u64,
            dst: dst.as_mut_ptr() as u64,
            len: 16,
        };
        // SAFETY: both buffers are live and distinct; `dst` is read below only through
        // `read_volatile` while the ticket is outstanding, and not written.
        let ticket = unsafe { b.submit(Direction::Load, &[run]) }.unwrap();
        loop {
            let done = b.query(ticket).unwrap();
            // SAFETY: in bounds of the live `dst`.
            let first = unsafe { std::ptr::read_volatile(dst.as_ptr()) };
            if done {
                break;
            }
            assert_eq!(first, 0, "the bytes landed before the copy completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(dst, [9u8; 16]);
    }
}
