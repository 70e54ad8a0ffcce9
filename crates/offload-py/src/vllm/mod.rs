//! Everything that reads vLLM's own structures, in one place: its allocated blocks
//! ([`blocks`]), the lists of a
//! `SchedulerOutput` and the plan handed back ([`step`]), one step into the core
//! ([`schedule`]), the running requests a step may leave out ([`running`]) and vLLM's GPU
//! free queue, walked in place for lazy mode ([`free_queue`]), whose candidates reach the
//! planner without their keys crossing into Python ([`lazy`]). The rest of the binding
//! converts plain values and maps errors; the Python package's `vllm_adapter` is the
//! other language's counterpart of this module.

pub(crate) mod blocks;
pub(crate) mod free_queue;
pub(crate) mod lazy;
pub(crate) mod running;
pub(crate) mod schedule;
pub(crate) mod step;
