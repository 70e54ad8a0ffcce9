//! Fixtures shared by the integration tests, one file per area. Each test binary uses a
//! part of them, so the unused rest must not warn there.
#![allow(dead_code, unreachable_pub)]

pub mod disk;
pub mod fake_cuda;
pub mod planner;
pub mod rng;
pub mod tier;
pub mod transfer;
