//! [`StackedStore`]: two stores as one, the near one (local disk) asked first, so the
//! planner's one lookup path continues a hit from CPU to disk to the remote store without
//! knowing there are two.

use super::{BlockFill, Fill, LayoutFingerprint, RemoteKey, RemoteStore, TierError, ValueParts};

/// `near` in front of `far`: reads try `near` first, writes go to both.
pub struct StackedStore {
    near: Box<dyn RemoteStore>,
    far: Box<dyn RemoteStore>,
}

impl std::fmt::Debug for StackedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl StackedStore {
    /// `near` (the disk) in front of `far` (the remote store).
    pub fn new(near: Box<dyn RemoteStore>, far: Box<dyn RemoteStore>) -> Self {
        Self { near, far }
    }

    /// Asks `near` for every key, then `far` for the keys `near` did not answer with a
    /// hit (a miss or a failure there is not final).
    fn fall_through<T>(
        &mut self,
        keys: &[RemoteKey],
        near: impl FnOnce(&mut dyn RemoteStore, &[RemoteKey]) -> Vec<Result<T, TierError>>,
        far: impl FnOnce(&mut dyn RemoteStore, &[RemoteKey]) -> Vec<Result<T, TierError>>,
        hit: impl Fn(&T) -> bool,
    ) -> Vec<Result<T, TierError>> {
        let mut out = near(self.near.as_mut(), keys);
        if out.len() != keys.len() {
            // A store that skipped keys answered nothing usable; the far one answers all.
            return far(self.far.as_mut(), keys);
        }
        let rest: Vec<usize> = (0..keys.len())
            .filter(|&i| !matches!(&out[i], Ok(v) if hit(v)))
            .collect();
        if rest.is_empty() {
            return out;
        }
        let asked: Vec<RemoteKey> = rest.iter().map(|&i| keys[i].clone()).collect();
        let answers = far(self.far.as_mut(), &asked);
        if answers.len() == asked.len() {
            for (i, a) in rest.into_iter().zip(answers) {
                out[i] = a;
            }
        }
        out
    }
}

impl RemoteStore for StackedStore {
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
        self.fall_through(keys, |s, k| s.exists(k), |s, k| s.exists(k), |v| *v)
    }

    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        self.fall_through(keys, |s, k| s.get(k), |s, k| s.get(k), Option::is_some)
    }

    /// Into the destinations, from `near` (the disk reads straight into them) and, for the
    /// blocks it did not have, from `far`: as [`Self::get`], a value `near` had and the
    /// fill rejected is not asked of `far`.
    fn get_into(
        &mut self,
        keys: &[RemoteKey],
        fingerprint: LayoutFingerprint,
        blocks: &mut [BlockFill<'_, '_>],
    ) -> Vec<Result<Fill, TierError>> {
        let mut out = self.near.get_into(keys, fingerprint, blocks);
        let rest: Vec<usize> = if out.len() == keys.len() {
            (0..keys.len())
                .filter(|&i| !matches!(out[i], Ok(Fill::Filled | Fill::Rejected(_))))
                .collect()
        } else {
            // A store that skipped keys answered nothing usable; the far one answers all.
            out = (0..keys.len()).map(|_| Ok(Fill::Missing)).collect();
            (0..keys.len()).collect()
        };
        if rest.is_empty() {
            return out;
        }
        let asked: Vec<RemoteKey> = rest.iter().map(|&i| keys[i].clone()).collect();
        let mut wanted = vec![false; blocks.len()];
        for &i in &rest {
            wanted[i] = true;
        }
        // The same destinations, reborrowed for the far store's call.
        let mut theirs: Vec<BlockFill<'_, '_>> = blocks
            .iter_mut()
            .zip(&wanted)
            .filter(|(_, &w)| w)
            .map(|(b, _)| BlockFill::new(b.hash, b.parts.iter_mut().map(|p| &mut **p).collect()))
            .collect();
        let answers = self.far.get_into(&asked, fingerprint, &mut theirs);
        if answers.len() == asked.len() {
            for (i, a) in rest.into_iter().zip(answers) {
                out[i] = a;
            }
        }
        out
    }

    /// Both stores get every block; a block counts as written when either took it.
    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
        let near = self.near.put(entries);
        let far = self.far.put(entries);
        either_took(near, far, entries.len())
    }

    /// As [`Self::put`], each store encoding the parts its own way.
    fn put_parts(&mut self, entries: &[(RemoteKey, ValueParts<'_>)]) -> Vec<Result<(), TierError>> {
        let near = self.near.put_parts(entries);
        let far = self.far.put_parts(entries);
        either_took(near, far, entries.len())
    }

    fn discard(&mut self, keys: &[RemoteKey]) {
        self.near.discard(keys);
        self.far.discard(keys);
    }

    fn describe(&self) -> String {
        format!("{} then {}", self.near.describe(), self.far.describe())
    }
}

/// Per block, written when either store took it; a store that skipped blocks answered
/// nothing usable.
fn either_took(
    near: Vec<Result<(), TierError>>,
    far: Vec<Result<(), TierError>>,
    blocks: usize,
) -> Vec<Result<(), TierError>> {
    if near.len() != blocks {
        return far;
    }
    if far.len() != blocks {
        return near;
    }
    near.into_iter().zip(far).map(|(n, f)| n.or(f)).collect()
}
