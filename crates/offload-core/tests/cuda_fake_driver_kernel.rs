//! The CUDA backend's copy kernel against the fake driver: which jobs take it, that its
//! copies land byte for byte in stream order, its fallbacks, and that its module and run
//! tables are released. (On a GPU, `scripts/gpu_check.py` round-trips it for real.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::fake_cuda::{
    assert_released, engine, options, round_trip, store, Fake, CUDA_ERROR_INVALID_VALUE, SCATTERED,
};
use common::transfer::{run_one, FakeGpu, WAIT};
use offload_core::transfer::{
    CopyBackend, CopyPath, CudaCopyBackend, ReadyError, TransferEngine, AUTO_KERNEL_BELOW_BYTES,
};

const DEVICEMAP_FLAGS: i32 = 0x1 | 0x2;
const PORTABLE_ONLY: i32 = 0x1;
const CUDA_ERROR_INVALID_IMAGE: i32 = 200;

/// Round-trips SCATTERED through an engine of `block`-byte blocks; returns
/// (kernel launches, batch calls) it took.
fn round_trip_counts(fake: &Fake, path: CopyPath, block: usize) -> (i64, i64) {
    let gpu = FakeGpu::new(16 * block);
    gpu.fill_random(block as u64);
    let engine = engine(
        vec![gpu.region(16, block, block)],
        16,
        fake.backend(options(path)),
    );
    round_trip(&engine, &gpu, block, SCATTERED);
    drop(engine);
    assert_released(fake);
    (
        fake.get("fake_kernel_launches"),
        fake.get("fake_batch_calls"),
    )
}

#[test]
fn the_kernel_round_trips_scattered_blocks_byte_for_byte() {
    let fake = Fake::full();
    let (launches, batches) = round_trip_counts(&fake, CopyPath::Kernel, 4096);
    assert_eq!((launches, batches), (2, 0), "{}", fake.log());
    // One upload of the run table before each launch, both on the job's stream.
    assert_eq!(fake.get("fake_htod_calls"), 2);
    let log = fake.log();
    let upload = log.find("htod:").expect("no table upload");
    let launch = log.find("kernel:").expect("no launch");
    assert!(upload < launch, "{log}");
    // Host memory is mapped into the device for the kernel.
    assert_eq!(fake.get_int("fake_last_register_flags"), DEVICEMAP_FLAGS);
    assert_eq!(fake.get("fake_unpinned_copies"), 0);
}

#[test]
fn odd_sizes_take_the_kernel_byte_path() {
    // 24-byte blocks: neither the runs nor their addresses are multiples of 16.
    let fake = Fake::full();
    let (launches, _) = round_trip_counts(&fake, CopyPath::Kernel, 24);
    assert_eq!(launches, 2);
}

#[test]
fn auto_takes_the_kernel_for_small_runs_and_the_copy_engines_for_large_ones() {
    let fake = Fake::full();
    assert_eq!(round_trip_counts(&fake, CopyPath::Auto, 4096), (2, 0));
    // Runs of AUTO_KERNEL_BELOW_BYTES and more go to the copy engines (counters add up).
    assert_eq!(
        round_trip_counts(&fake, CopyPath::Auto, AUTO_KERNEL_BELOW_BYTES),
        (2, 2)
    );
    // "dma" never launches the kernel, and does not map host memory into the device.
    assert_eq!(round_trip_counts(&fake, CopyPath::Dma, 4096), (2, 4));
    assert_eq!(fake.get_int("fake_last_register_flags"), PORTABLE_ONLY);
}

#[test]
fn the_launch_describes_the_job() {
    let fake = Fake::full();
    let block = 64;
    let gpu = FakeGpu::new(64 * block);
    let engine = engine(
        vec![gpu.region(64, block, block), gpu.region(64, block, block)],
        64,
        fake.backend(options(CopyPath::Kernel)),
    );
    // 40 blocks, no two adjacent on the device: 40 runs per region.
    let pairs: Vec<(u32, u32)> = (0..40).map(|i| (i * 3 % 64, i)).collect();
    let pairs: Vec<(u32, u32)> = pairs.into_iter().filter(|&(g, _)| g % 2 == 0).collect();
    assert_eq!(run_one(&engine, store(1, &pairs)).result, Ok(()));
    assert_eq!(fake.get("fake_last_kernel_count"), 2 * pairs.len() as i64);
    assert_eq!(fake.get_int("fake_last_kernel_block"), 256);
    assert_eq!(fake.get_int("fake_last_kernel_grid"), 16);
    assert!(
        engine
            .backend_detail()
            .contains("copy kernel for every job"),
        "{}",
        engine.backend_detail()
    );
}

#[test]
fn a_kernel_store_waits_for_the_compute_event_before_reading() {
    let fake = Fake::full();
    let block = 64;
    let gpu = FakeGpu::new(8 * block);
    gpu.bytes_mut().fill(0x11);
    let mut engine = engine(
        vec![gpu.region(8, block, block)],
        8,
        fake.backend(options(CopyPath::Kernel)),
    );
    let compute_done = fake.user_event();
    engine
        .submit(store(1, &[(2, 5)]).with_wait_event(compute_done))
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let mut done = Vec::new();
    engine.poll_completions(&mut done);
    assert!(done.is_empty(), "the store completed before its event");
    gpu.bytes_mut()[2 * block..3 * block].fill(0x22);
    fake.user_event_call(b"fake_user_event_complete", compute_done);
    let done = engine.wait_for(&[1], WAIT).unwrap();
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(engine.cpu_block_slice(0, 5).unwrap(), &[0x22u8; 64][..]);
    fake.user_event_call(b"fake_user_event_destroy", compute_done);
}

#[test]
fn run_tables_are_reused_not_allocated_per_job() {
    let fake = Fake::full();
    let block = 256;
    let gpu = FakeGpu::new(32 * block);
    gpu.fill_random(5);
    let engine = engine(
        vec![gpu.region(32, block, block)],
        32,
        fake.backend(options(CopyPath::Kernel)),
    );
    for id in 0..200u64 {
        let g = (id % 16) as u32 * 2;
        assert_eq!(run_one(&engine, store(id, &[(g, g)])).result, Ok(()));
    }
    assert_eq!(fake.get("fake_kernel_launches"), 200);
    assert!(
        fake.get_int("fake_live_allocations") <= 2,
        "{} tables for one job at a time",
        fake.get_int("fake_live_allocations")
    );
    drop(engine);
    assert_released(&fake);
}

#[test]
fn a_failed_launch_fails_its_job_only() {
    let fake = Fake::full();
    let block = 128;
    let gpu = FakeGpu::new(16 * block);
    gpu.fill_random(9);
    let engine = engine(
        vec![gpu.region(16, block, block)],
        16,
        fake.backend(options(CopyPath::Kernel)),
    );
    fake.fail_copy_at(0, CUDA_ERROR_INVALID_VALUE);
    let failed = run_one(&engine, store(1, &[(1, 1)]));
    let err = failed.result.unwrap_err().to_string();
    assert!(err.contains("cuLaunchKernel"), "{err}");
    fake.set("fake_fail_next_htod", CUDA_ERROR_INVALID_VALUE);
    let err = run_one(&engine, store(2, &[(2, 2)]))
        .result
        .unwrap_err()
        .to_string();
    assert!(err.contains("cuMemcpyHtoDAsync"), "{err}");
    fake.set("fake_fail_next_alloc", 2);
    // The free table from the jobs above is reused: no allocation, so this one succeeds.
    assert_eq!(run_one(&engine, store(3, &[(3, 3)])).result, Ok(()));
    round_trip(&engine, &gpu, block, SCATTERED);
    drop(engine);
    assert_released(&fake);
}

#[test]
fn without_the_kernel_functions_auto_falls_back_and_kernel_refuses() {
    let fake = Fake::new(&["-DNO_COPY_KERNEL"]);
    let (launches, batches) = round_trip_counts(&fake, CopyPath::Auto, 4096);
    assert_eq!((launches, batches), (0, 2));
    assert_eq!(fake.get_int("fake_last_register_flags"), PORTABLE_ONLY);

    let gpu = FakeGpu::new(16 * 64);
    let engine = TransferEngine::with_backend(
        vec![gpu.region(16, 64, 64)],
        16,
        common::fake_cuda::config(),
        fake.backend(options(CopyPath::Kernel)),
    )
    .unwrap();
    let err = engine.wait_ready(WAIT).unwrap_err();
    let ReadyError::Stopped { reason } = &err else {
        panic!("expected the engine to stop, got {err:?}");
    };
    assert!(
        reason.contains("copy kernel cannot be used") && reason.contains("cuLaunchKernel"),
        "{reason}"
    );
    drop(engine);
    assert_released(&fake);
}

#[test]
fn a_module_that_fails_to_load_leaves_auto_on_the_copy_engines() {
    let fake = Fake::full();
    fake.set("fake_fail_module_load", CUDA_ERROR_INVALID_IMAGE);
    let mut backend: CudaCopyBackend = fake.backend(options(CopyPath::Auto));
    let mut host = vec![0u8; 4096];
    backend
        .attach(host.as_mut_ptr() as u64, host.len())
        .unwrap();
    assert!(!backend.kernel_loaded());
    assert!(
        !backend.describe().contains("kernel"),
        "{}",
        backend.describe()
    );
    drop(backend);
    assert_released(&fake);
}
