//! Fixtures shared by the integration tests. Each test crate uses only some of them, so
//! the unused rest must not warn there.
#![allow(dead_code, unreachable_pub)]

pub mod planner;
