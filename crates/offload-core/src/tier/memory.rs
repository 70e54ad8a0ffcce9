//! [`MemoryStore`]: a [`RemoteStore`] in this process, for tests of everything above the
//! store (planner and worker integration) without a Redis server.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use super::{RemoteKey, RemoteStore, TierError};

#[derive(Debug, Default)]
struct State {
    values: HashMap<RemoteKey, Vec<u8>>,
    paused: bool,
    calls: u64,
}

#[derive(Debug, Default)]
struct Inner {
    state: Mutex<State>,
    resumed: Condvar,
}

/// A shared map of values. Clones are handles on the same map, so a writer's tier and a
/// reader's tier see each other's blocks like two engines on one store.
///
/// [`Self::pause`] holds every call until [`Self::resume`], as a slow network would.
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use offload_core::tier::{KeySpace, KvLayout, LayoutFingerprint, MemoryStore, RemoteTier, TierStats};
///
/// let store = MemoryStore::default();
/// let keys = KeySpace::new("doc", LayoutFingerprint(7)).unwrap();
/// let mut a = RemoteTier::new(Box::new(store.clone()), keys.clone(), Arc::new(TierStats::default()));
/// let mut b = RemoteTier::new(Box::new(store), keys, Arc::new(TierStats::default()));
/// a.store(&[([1u8; 32], vec![vec![5u8; 64]])]).unwrap();
/// assert_eq!(b.probe_chain(&[[1u8; 32], [2u8; 32]]).unwrap(), 1);
/// let got = b.fetch(&[[1u8; 32]], 64).unwrap();
/// assert_eq!(got[0].as_ref().unwrap().payload(), &[5u8; 64][..]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl MemoryStore {
    /// Holds every call from now on until [`Self::resume`].
    pub fn pause(&self) {
        self.lock().paused = true;
    }

    /// Lets held and later calls through.
    pub fn resume(&self) {
        self.lock().paused = false;
        self.inner.resumed.notify_all();
    }

    /// Calls answered so far (each is one round trip).
    pub fn calls(&self) -> u64 {
        self.lock().calls
    }

    /// Replaces the raw value under `key`, as another writer (or a fault) would.
    pub fn set_raw(&self, key: RemoteKey, value: Vec<u8>) {
        self.lock().values.insert(key, value);
    }

    /// The raw value under `key`.
    pub fn get_raw(&self, key: &RemoteKey) -> Option<Vec<u8>> {
        self.lock().values.get(key).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The state once no pause holds the call, counted as one call.
    fn call(&self) -> std::sync::MutexGuard<'_, State> {
        let mut state = self.lock();
        while state.paused {
            state = self
                .inner
                .resumed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.calls += 1;
        state
    }
}

impl RemoteStore for MemoryStore {
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
        let state = self.call();
        keys.iter()
            .map(|k| Ok(state.values.contains_key(k)))
            .collect()
    }

    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let state = self.call();
        keys.iter()
            .map(|k| Ok(state.values.get(k).cloned()))
            .collect()
    }

    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
        let mut state = self.call();
        entries
            .iter()
            .map(|(k, v)| {
                state.values.insert(k.clone(), v.clone());
                Ok(())
            })
            .collect()
    }

    fn describe(&self) -> String {
        "in-process store".into()
    }
}
