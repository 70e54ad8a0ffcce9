//! Fixtures shared by the integration tests, one file per area. Each test binary uses a
//! part of them.
#![allow(dead_code, unreachable_pub)]

pub mod rng;
pub mod transfer;
