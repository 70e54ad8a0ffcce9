//! Embedding offload-core in a server that is not vLLM: a toy "server" whose KV cache is
//! host memory, serving two requests that share a prompt. The second one loads the shared
//! blocks from the CPU tier instead of recomputing them.
//!
//! Run with `cargo run -p offload-core --example embed`.

use std::time::Duration;

use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};
use offload_core::{BlockHash, Planner, PlannerConfig};

const BLOCK_TOKENS: usize = 16;
const BLOCK_BYTES: usize = 4096;
const GPU_BLOCKS: u32 = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server's own KV cache: one region of GPU_BLOCKS blocks (host memory here).
    let mut kv = vec![0u8; GPU_BLOCKS as usize * BLOCK_BYTES];
    // SAFETY: `kv` outlives the engine (dropped at the end of main, after the engine is
    // shut down) and is not touched while a transfer on a block is in flight.
    let region =
        unsafe { RegionSpec::new(kv.as_mut_ptr() as u64, GPU_BLOCKS, BLOCK_BYTES, BLOCK_BYTES)? };
    let mut engine = TransferEngine::new(vec![region], 256, TransferConfig::default())?;
    let mut planner = Planner::new(PlannerConfig {
        block_size: BLOCK_TOKENS as u32,
        num_cpu_blocks: engine.num_cpu_blocks(),
        ..PlannerConfig::default()
    });

    // Request "a": a 4-block prompt computed into GPU blocks 0..=4 (the server's forward
    // pass writes its KV; here every byte of block i is i + 1).
    let prompt: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
    let gpu_a: Vec<u32> = (0..5).collect();
    planner.extend_hashes("a", prompt.iter().copied());
    planner.lookup("a", 4 * BLOCK_TOKENS + 1, 0)?;
    planner.on_alloc("a", &gpu_a, 0, 0)?;
    planner.note_scheduled("a", 0, &gpu_a, true)?;
    for (i, block) in kv.chunks_mut(BLOCK_BYTES).take(4).enumerate() {
        block.fill(i as u8 + 1);
    }
    // "a" finishes: its full blocks go to the CPU tier; keep its GPU blocks until then.
    let keep_blocks = planner.request_finished("a", 4 * BLOCK_TOKENS)?;
    run_step(&mut planner, &engine)?;
    let done = planner.take_completions();
    println!(
        "request a: keep GPU blocks = {keep_blocks}, released = {:?}",
        done.finished_sending
    );

    // Request "b" shares the prompt and gets GPU blocks 10..=14 (its KV there is garbage).
    planner.extend_hashes("b", prompt.iter().copied());
    let hit = planner.lookup("b", 4 * BLOCK_TOKENS + 1, 0)?;
    let gpu_b: Vec<u32> = (10..15).collect();
    planner.on_alloc("b", &gpu_b, 0, hit)?;
    run_step(&mut planner, &engine)?;
    println!(
        "request b: {hit} prompt tokens loaded from CPU, ready = {:?}",
        planner.take_completions().finished_recving
    );

    engine.shutdown(Duration::from_secs(5))?;
    for (i, block) in kv.chunks(BLOCK_BYTES).skip(10).take(4).enumerate() {
        assert!(
            block.iter().all(|b| *b == i as u8 + 1),
            "block {i} loaded wrong bytes"
        );
    }
    println!("loaded KV matches what request a computed");
    println!("stats: {:?}", planner.stats());
    Ok(())
}

/// Hands the planner's transfers to the engine and feeds the completions back.
fn run_step(
    planner: &mut Planner,
    engine: &TransferEngine,
) -> Result<(), Box<dyn std::error::Error>> {
    let plan = planner.take_step();
    let mut ids = Vec::new();
    for load in plan.loads {
        ids.push(load.id);
        let pairs = load.gpu_blocks.into_iter().zip(load.cpu_blocks).collect();
        engine.submit(TransferJob::new(load.id, Direction::Load, pairs))?;
    }
    if let Some(store) = plan.store {
        ids.push(store.id);
        let pairs = store.gpu_blocks.into_iter().zip(store.cpu_blocks).collect();
        engine.submit(TransferJob::new(store.id, Direction::Store, pairs))?;
    }
    for c in engine.wait_for(&ids, Duration::from_secs(10))? {
        planner.complete(c.id, c.result.is_ok())?;
    }
    Ok(())
}
