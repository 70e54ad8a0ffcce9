//! `parse_config` and the `OffloadConfig` class.

use std::collections::BTreeMap;

use offload_core::tier::redact_url;
use offload_core::{KvCacheLayout, OffloadConfig};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping};

use crate::convert::{config_value, type_name};
use crate::errors::{config_err, CONFIG_ERROR};

/// Validated settings of one rank.
#[pyclass(module = "kvoffload._native", name = "OffloadConfig", frozen)]
#[derive(Debug, Clone)]
pub(crate) struct PyOffloadConfig {
    pub(crate) inner: OffloadConfig,
}

#[pymethods]
impl PyOffloadConfig {
    #[getter]
    fn cpu_bytes_per_rank(&self) -> u64 {
        self.inner.cpu_bytes_per_rank
    }

    #[getter]
    fn lazy_offload(&self) -> bool {
        self.inner.lazy_offload
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    /// The fault-injection spec for the transfer engine (unparsed), or `None`.
    #[getter]
    fn faults(&self) -> Option<String> {
        self.inner.faults.clone()
    }

    /// The `kv_cache_layout` key: `"auto"`, `"engine"` or a vLLM layout name.
    #[getter]
    fn kv_cache_layout(&self) -> String {
        match &self.inner.kv_cache_layout {
            KvCacheLayout::Engine => "engine".to_owned(),
            KvCacheLayout::Named(name) => name.clone(),
            _ => "auto".to_owned(),
        }
    }

    /// The `kv_cache_version` key (the operator's version of the weights), or `None`.
    #[getter]
    fn kv_cache_version(&self) -> Option<String> {
        self.inner.kv_cache_version.clone()
    }

    /// The remote tier's settings (URLs with passwords masked), or `None` without
    /// `remote_url`.
    #[getter]
    fn remote<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(r) = &self.inner.remote else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let shown: Vec<String> = r.seeds.iter().map(|s| redact_url(s)).collect();
        d.set_item("url", shown.join(","))?;
        d.set_item("namespace", &r.namespace)?;
        d.set_item("timeout_ms", r.timeout_ms)?;
        d.set_item("write", r.write)?;
        d.set_item("max_inflight_bytes", r.max_inflight_bytes)?;
        Ok(Some(d))
    }

    /// The disk tier's settings, or `None` unless `kv_offload_backend` is `"disk"`.
    #[getter]
    fn disk<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(d) = &self.inner.disk else {
            return Ok(None);
        };
        let out = PyDict::new(py);
        out.set_item("path", d.path.to_string_lossy())?;
        out.set_item("capacity_bytes", d.capacity_bytes)?;
        out.set_item("buffer_slots", d.buffer_slots)?;
        out.set_item("use_page_cache", d.use_page_cache)?;
        out.set_item("persist", d.persist)?;
        out.set_item("cpu_in_front", d.cpu_in_front)?;
        Ok(Some(out))
    }

    /// Whether a tier below the CPU (disk, remote or both) is configured.
    #[getter]
    fn has_lower_tier(&self) -> bool {
        self.inner.disk.is_some() || self.inner.remote.is_some()
    }

    /// Whether stored blocks are written to a lower tier (the disk always; the remote
    /// store unless `remote_write` is off).
    #[getter]
    fn writes_lower(&self) -> bool {
        self.inner.disk.is_some() || self.inner.remote.as_ref().is_some_and(|r| r.write)
    }

    /// Whether host memory only stages the disk tier (no CPU budget given).
    #[getter]
    fn cpu_stages_only(&self) -> bool {
        self.inner.cpu_stages_only()
    }

    /// This config with the staging pool sized for `serve_blocks` blocks of
    /// `bytes_per_block` (see `OffloadConfig::stage_for`); unchanged without staging.
    fn staged(&self, serve_blocks: u32, bytes_per_block: u64) -> Self {
        let mut inner = self.inner.clone();
        inner.stage_for(serve_blocks, bytes_per_block);
        Self { inner }
    }

    /// Whether loads are synchronous, given where vLLM keeps the KV cache.
    fn sync_loads(&self, kv_in_host_memory: bool) -> bool {
        self.inner.load_mode.is_sync(kv_in_host_memory)
    }

    fn num_cpu_blocks(&self, bytes_per_block: u64) -> PyResult<u32> {
        self.inner
            .num_cpu_blocks(bytes_per_block)
            .map_err(config_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "OffloadConfig(cpu_bytes_per_rank={}, lazy_offload={}, world_size={})",
            self.inner.cpu_bytes_per_rank,
            if self.inner.lazy_offload {
                "True"
            } else {
                "False"
            },
            self.inner.world_size
        )
    }
}

/// Parses `kv_connector_extra_config` for one rank; returns the config and warnings.
#[pyfunction]
#[pyo3(signature = (extra, world_size))]
pub(crate) fn parse_config(
    extra: &Bound<'_, PyAny>,
    world_size: i64,
) -> PyResult<(PyOffloadConfig, Vec<String>)> {
    let mut map = BTreeMap::new();
    if !extra.is_none() {
        let mapping = extra.cast::<PyMapping>().map_err(|_| {
            CONFIG_ERROR.err(format!(
                "kv_connector_extra_config must be a mapping, got {}",
                type_name(extra)
            ))
        })?;
        for item in mapping.items()?.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let key: String = k.extract().map_err(|_| {
                CONFIG_ERROR.err(format!("config keys must be str, got {}", type_name(&k)))
            })?;
            map.insert(key, config_value(&v));
        }
    }
    let world = u32::try_from(world_size)
        .map_err(|_| CONFIG_ERROR.err(format!("kvoffload: invalid world_size: {world_size}")))?;
    let parsed = OffloadConfig::from_map(&map, world).map_err(config_err)?;
    Ok((
        PyOffloadConfig {
            inner: parsed.config,
        },
        parsed.warnings,
    ))
}
