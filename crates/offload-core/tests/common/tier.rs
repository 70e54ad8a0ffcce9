//! Remote tier fixtures: a real Redis Cluster on loopback (through
//! `scripts/redis_cluster.sh`, stopped on drop) and a fake server for protocol faults.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use offload_core::tier::{KeySpace, KvLayout, RedisStore, RemoteTier, TierStats};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../scripts/redis_cluster.sh"
);

/// Cluster starts pick free ports; one at a time so two tests never pick the same ones.
static STARTING: Mutex<()> = Mutex::new(());

/// Deadline of every call in the tests: generous for a loaded CI machine.
pub const TIMEOUT: Duration = Duration::from_millis(1000);

/// A master of a running cluster.
pub struct Master {
    pub port: u16,
    pub id: String,
    /// Inclusive slot ranges it serves.
    pub slots: Vec<(u16, u16)>,
}

/// A running cluster, stopped when dropped.
pub struct Cluster {
    dir: PathBuf,
    pub url: String,
    pub password: Option<String>,
}

impl Cluster {
    /// Three masters with `replicas` replicas each, optionally behind a password.
    pub fn start(replicas: u32, password: Option<&str>) -> Self {
        let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        let mut cmd = Command::new("bash");
        cmd.arg(SCRIPT)
            .arg("start")
            .env("REDIS_CLUSTER_REPLICAS", replicas.to_string())
            .env("REDIS_CLUSTER_NODE_TIMEOUT_MS", "1000");
        if let Some(pw) = password {
            cmd.env("REDIS_CLUSTER_PASSWORD", pw);
        }
        let out = cmd.output().expect("run redis_cluster.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "redis_cluster.sh start failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let field = |name: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {stdout}"))
                .to_string()
        };
        Self {
            dir: PathBuf::from(field("REDIS_CLUSTER_DIR=")),
            url: field("REDIS_CLUSTER_URL="),
            password: password.map(str::to_string),
        }
    }

    pub fn seeds(&self) -> Vec<String> {
        self.url.split(',').map(str::to_string).collect()
    }

    /// A plain connection to one node, for setting the cluster up behind the tier's back.
    pub fn node(&self, port: u16) -> redis::Connection {
        let auth = self
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        redis::Client::open(format!("redis://{auth}127.0.0.1:{port}"))
            .and_then(|c| c.get_connection_with_timeout(TIMEOUT))
            .expect("connect to a node")
    }

    /// Every master that is up, as `via` sees the cluster.
    pub fn masters(&self, via: u16) -> Vec<Master> {
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut self.node(via))
            .expect("CLUSTER NODES");
        nodes
            .lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let port = f[1]
                    .split(['@', ':'])
                    .nth(1)
                    .and_then(|p| p.parse().ok())
                    .expect("node port");
                let slots = f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .map(|s| match s.split_once('-') {
                        Some((a, b)) => (a.parse().unwrap_or(0), b.parse().unwrap_or(0)),
                        None => {
                            let n = s.parse().unwrap_or(0);
                            (n, n)
                        }
                    })
                    .collect();
                Master {
                    port,
                    id: f[0].to_string(),
                    slots,
                }
            })
            .collect()
    }

    /// Waits until every write the master on `port` took reached a replica.
    pub fn wait_replicated(&self, port: u16) {
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(10_000)
            .query(&mut self.node(port))
            .expect("WAIT");
        assert!(acked >= 1, "no replica of {port} acknowledged the writes");
    }

    /// The slot of `key`.
    pub fn slot(&self, via: u16, key: &str) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.node(via))
            .expect("CLUSTER KEYSLOT")
    }

    /// The port of the master serving `key`.
    pub fn master_of(&self, via: u16, key: &str) -> u16 {
        let slot = self.slot(via, key);
        self.masters(via)
            .into_iter()
            .find(|m| m.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|m| m.port)
            .expect("a master serves the slot")
    }

    /// Kills the server on `port` at once (SIGKILL), like a crashed machine.
    pub fn kill(&self, port: u16) {
        self.signal(port, "-KILL");
    }

    /// Stops the server on `port` without closing its sockets (SIGSTOP), like a machine
    /// that hangs or drops off the network: connections stay open and nothing answers.
    pub fn freeze(&self, port: u16) {
        self.signal(port, "-STOP");
    }

    fn signal(&self, port: u16, signal: &str) {
        let pid = std::fs::read_to_string(self.dir.join(format!("{port}.pid"))).expect("pid");
        let ok = Command::new("kill")
            .args([signal, pid.trim()])
            .status()
            .expect("kill");
        assert!(ok.success());
    }

    pub fn port(seed: &str) -> u16 {
        seed.rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("seed port")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(SCRIPT)
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

/// A small layout; `tp_rank` picks another fingerprint.
pub fn layout(tp_rank: u32) -> KvLayout {
    KvLayout {
        model_id: "test/model".into(),
        dtype: "bfloat16".into(),
        block_size: 16,
        num_layers: 2,
        num_kv_heads: 2,
        head_size: 64,
        tp_rank,
        tp_size: 2,
        kv_cache_group: 0,
        hash_algo: "sha256".into(),
        none_hash_seed: "vllm-none-hash".into(),
        weights: "checkpoint:test".into(),
    }
}

/// A tier on `seeds` under `namespace` for `layout`, with fresh counters.
pub fn tier(seeds: &[String], namespace: &str, layout: &KvLayout) -> RemoteTier {
    let store = RedisStore::connect(seeds, TIMEOUT).expect("connect");
    let keys = KeySpace::new(namespace, layout.fingerprint()).expect("keys");
    RemoteTier::new(Box::new(store), keys, Arc::new(TierStats::default()))
}

/// `n` distinct 32-byte hashes starting at `first`.
pub fn hashes(first: u8, n: usize) -> Vec<[u8; 32]> {
    (0..n)
        .map(|i| {
            let mut h = [first; 32];
            h[..8].copy_from_slice(&(i as u64).to_le_bytes());
            h
        })
        .collect()
}

/// A block's bytes, distinct per `seed`.
pub fn block(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(131)) as u8)
        .collect()
}

/// Runs `f` on a thread and fails the test if it does not return within `limit`: a call
/// past its deadline would otherwise hang the suite instead of failing it.
pub fn no_hang<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("call did not return within {limit:?}: it hangs"))
}

/// How a [`FakeServer`] answers data commands (GET, EXISTS, SET).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Accepts connections and never answers anything.
    Silent,
    /// Answers the handshake and the topology, then never answers data commands.
    StallData,
    /// Answers data commands with bytes that are not RESP.
    Garbage,
    /// Answers data commands with an integer (GET) or a bulk string (EXISTS).
    WrongType,
}

/// A one-node "cluster" on loopback that misbehaves as told.
pub struct FakeServer {
    pub port: u16,
}

impl FakeServer {
    pub fn start(fault: Fault) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || serve(stream, fault, port));
            }
        });
        Self { port }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

fn serve(stream: TcpStream, fault: Fault, port: u16) {
    let mut out = match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    let mut input = BufReader::new(stream);
    while let Some(args) = read_command(&mut input) {
        if fault == Fault::Silent {
            continue;
        }
        let name = args
            .first()
            .map(|a| a.to_ascii_uppercase())
            .unwrap_or_default();
        let reply: Vec<u8> = match name.as_slice() {
            b"CLUSTER" => format!(
                "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:{port}\r\n$2\r\nid\r\n"
            )
            .into_bytes(),
            b"PING" => b"+PONG\r\n".to_vec(),
            b"GET" | b"EXISTS" | b"SET" => match fault {
                Fault::StallData | Fault::Silent => continue,
                Fault::Garbage => b"?this is not RESP\r\n".to_vec(),
                Fault::WrongType if name == b"GET" => b":5\r\n".to_vec(),
                Fault::WrongType => b"$3\r\nabc\r\n".to_vec(),
            },
            _ => b"+OK\r\n".to_vec(),
        };
        if out.write_all(&reply).is_err() {
            return;
        }
    }
}

/// One RESP command (an array of bulk strings), or `None` at end of stream.
fn read_command(input: &mut BufReader<TcpStream>) -> Option<Vec<Vec<u8>>> {
    let mut line = String::new();
    input.read_line(&mut line).ok().filter(|&n| n > 0)?;
    let n: usize = line.trim().strip_prefix('*')?.parse().ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        input.read_line(&mut line).ok()?;
        let len: usize = line.trim().strip_prefix('$')?.parse().ok()?;
        let mut buf = vec![0u8; len + 2];
        input.read_exact(&mut buf).ok()?;
        buf.truncate(len);
        args.push(buf);
    }
    Some(args)
}
