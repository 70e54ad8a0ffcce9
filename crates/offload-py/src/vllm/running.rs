//! The running requests a step may leave out of the core.
//!
//! In a decode step most running requests fill no block, and the core has nothing to do
//! for them (see `offload_core::Planner::store_due`); finding each one by its id in the
//! core's table costs a string hash and a few cold cache lines per request per step. The
//! watch remembers, in the order vLLM lists them, the id objects of the previous step's
//! requests and the confirmed tokens each needs before the core has work for it. A
//! request is recognised by the identity of its id object (vLLM passes the same `str`
//! every step): the watch holds a reference to each, so no other object can take that
//! address while it is remembered. A request that is not recognised goes to the core, as
//! every request did before.

use pyo3::prelude::*;
use pyo3::types::PyString;

/// How far past the expected position a request is looked for: vLLM keeps its running
/// requests in order and only drops finished or preempted ones in between.
const WINDOW: usize = 8;

#[derive(Debug)]
struct Watched {
    /// Taken when the entry moves into the next step's watch.
    name: Option<Py<PyString>>,
    /// Confirmed tokens from which the core has work for the request; 0: always.
    due: usize,
}

/// The previous step's running requests and the step being read.
#[derive(Debug, Default)]
pub(crate) struct RunningWatch {
    prev: Vec<Watched>,
    /// Next position expected in `prev`.
    at: usize,
    next: Vec<Watched>,
}

impl RunningWatch {
    /// Starts reading a step of `n` scheduled requests.
    pub(crate) fn begin(&mut self, n: usize) {
        self.at = 0;
        self.next.clear();
        self.next.reserve(n);
    }

    /// Whether running request `name`, bringing no new blocks with `confirmed` tokens
    /// confirmed, needs nothing from the core this step; it is remembered either way
    /// when it does not (see [`Self::passed`]).
    pub(crate) fn skips(&mut self, name: &Bound<'_, PyString>, confirmed: usize) -> bool {
        let ptr = name.as_ptr();
        let end = self.prev.len().min(self.at + WINDOW);
        let Some(k) = (self.at..end).find(|&k| {
            self.prev[k]
                .name
                .as_ref()
                .is_some_and(|n| n.as_ptr() == ptr)
        }) else {
            return false;
        };
        self.at = k + 1;
        if confirmed >= self.prev[k].due {
            return false;
        }
        let entry = Watched {
            name: self.prev[k].name.take(),
            due: self.prev[k].due,
        };
        self.next.push(entry);
        true
    }

    /// Remembers `name`, passed to the core this step; returns its place for
    /// [`Self::set_due`].
    pub(crate) fn passed(&mut self, name: &Bound<'_, PyString>) -> usize {
        self.next.push(Watched {
            name: Some(name.clone().unbind()),
            due: 0,
        });
        self.next.len() - 1
    }

    /// What the core answered for the request remembered at `place`.
    pub(crate) fn set_due(&mut self, place: usize, due: usize) {
        if let Some(w) = self.next.get_mut(place) {
            w.due = due;
        }
    }

    /// Ends the step: its requests are the ones the next step is matched against.
    pub(crate) fn end(&mut self) {
        std::mem::swap(&mut self.prev, &mut self.next);
        self.next.clear();
    }

    /// Forgets every request (the core was reset).
    pub(crate) fn clear(&mut self) {
        self.prev.clear();
        self.next.clear();
        self.at = 0;
    }
}
