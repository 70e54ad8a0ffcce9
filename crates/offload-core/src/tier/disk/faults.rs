//! [`DiskFaults`]: the faults of a [`FaultPlan`] injected into the data file's I/O,
//! counting calls as they come (tests and `kvoffload.faults`).

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::transfer::fault::hits;
use crate::transfer::FaultPlan;

/// Which faults to inject into disk I/O, counting calls as they come.
#[derive(Debug, Default)]
pub(crate) struct DiskFaults {
    plan: FaultPlan,
    writes: AtomicU32,
    reads: AtomicU32,
}

impl DiskFaults {
    pub(crate) fn new(plan: FaultPlan) -> Self {
        Self {
            plan,
            ..Self::default()
        }
    }

    pub(crate) fn write_fault(&self) -> Option<io::Error> {
        let plan = &self.plan;
        if plan.disk_enospc_every == 0 && plan.disk_write_eio_every == 0 {
            return None;
        }
        let n = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if hits(n, plan.disk_enospc_every) {
            return Some(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        hits(n, plan.disk_write_eio_every).then(|| io::Error::from_raw_os_error(libc::EIO))
    }

    /// The fault for the next read: an error, a short read, or a flipped byte.
    pub(crate) fn read_fault(&self) -> Option<ReadFault> {
        let plan = &self.plan;
        if plan.disk_read_eio_every == 0
            && plan.disk_short_read_every == 0
            && plan.disk_corrupt_read_every == 0
        {
            return None;
        }
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if hits(n, plan.disk_read_eio_every) {
            Some(ReadFault::Eio)
        } else if hits(n, plan.disk_short_read_every) {
            Some(ReadFault::Short)
        } else if hits(n, plan.disk_corrupt_read_every) {
            Some(ReadFault::Corrupt)
        } else {
            None
        }
    }
}

pub(crate) enum ReadFault {
    Eio,
    Short,
    Corrupt,
}
