//! `kvoffload._native`: thin PyO3 bindings over `offload-core`.
//!
//! Type conversion and error mapping; every decision is in the core. What reads vLLM's
//! own structures (its scheduler output, free queue, running requests) is in the `vllm` module.

mod config;
mod convert;
mod errors;
mod planner;
mod stats_report;
mod tier;
mod transfer;
mod vllm;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<config::PyOffloadConfig>()?;
    m.add_class::<planner::PyPlanner>()?;
    m.add_class::<vllm::lazy::LazyCandidates>()?;
    m.add_class::<transfer::PyTransferEngine>()?;
    m.add_class::<tier::PyWorkerTier>()?;
    m.add_function(wrap_pyfunction!(tier::remote_sharing_problem, m)?)?;
    m.add_function(wrap_pyfunction!(tier::tier_block_hash, m)?)?;
    m.add_function(wrap_pyfunction!(config::parse_config, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
