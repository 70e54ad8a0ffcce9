//! [`RedisStore`]: a [`RemoteStore`] on Redis Cluster (or Valkey) through the `redis` crate.
//!
//! The async cluster client runs on a private single-threaded runtime that only turns while
//! a call waits for its answer. Each call sends one command per key at once; the client
//! writes them back to back on one connection per node (pipelined, one round trip) and
//! follows MOVED and ASK redirections itself. A deadline covers each call whole
//! (reconnecting, retries and redirections included): a key not answered by then is a
//! failed key, and the connection is rebuilt by the next call. The client alone would keep
//! routing to a master that hangs (it refreshes its slot map on errors, not on timeouts),
//! so without the rebuild a failover behind a hung master would never be seen; a killed,
//! frozen or failed-over master costs misses, never a hang or a stale route.
//!
//! Calls block the calling thread (never a tokio runtime's: the client's own runtime would
//! refuse to start inside another); [`WriteBehind`](super::WriteBehind) and
//! [`ProbeQueue`](super::ProbeQueue) make them on threads of their own.

use std::fmt;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};
use tokio::runtime::Runtime;
use tokio::time::{timeout_at, Instant};

use super::{RemoteKey, RemoteStore, TierError};

/// Retries per key for redirections and transient errors; the deadline bounds them anyway.
const RETRIES: u32 = 3;

/// A connection to a Redis Cluster, used from one thread at a time.
pub struct RedisStore {
    runtime: Runtime,
    client: ClusterClient,
    conn: Option<ClusterConnection>,
    timeout: Duration,
    seeds: String,
    secrets: Vec<String>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("seeds", &self.seeds)
            .field("timeout", &self.timeout)
            .field("connected", &self.conn.is_some())
            .finish()
    }
}

impl RedisStore {
    /// Connects to the cluster that `seeds` (`redis://` or `rediss://` URLs of any of its
    /// nodes, with `user:password@` when the cluster wants one) belong to. Every call,
    /// this one included, gives up after `timeout`.
    ///
    /// Connecting now, not on first use, puts a wrong URL or refused credentials in the
    /// startup log instead of a stream of misses.
    pub fn connect(seeds: &[String], timeout: Duration) -> Result<Self, TierError> {
        let timeout = timeout.max(Duration::from_millis(1));
        let shown = seeds
            .iter()
            .map(|s| redact_url(s))
            .collect::<Vec<_>>()
            .join(",");
        let mut infos = Vec::with_capacity(seeds.len());
        let mut secrets = Vec::new();
        for seed in seeds {
            let info = parse_seed(seed)?;
            if let Some(pw) = info.redis_settings().password() {
                secrets.push(pw.to_string());
            }
            infos.push(info);
        }
        let bad = |e: redis::RedisError| TierError::BadUrl {
            url: shown.clone(),
            reason: scrub(&e.to_string(), &secrets),
        };
        if infos
            .iter()
            .any(|i| matches!(i.addr(), ConnectionAddr::TcpTls { .. }))
        {
            // Several rustls providers may be linked into one process; pick ours
            // explicitly. An error means one is installed already, which serves as well.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // A node that accepts connections but never answers (a hung machine) must not eat
        // the whole deadline of the reconnection that follows a failure: connecting gives up
        // on such a node early, and the rest of the cluster is still reached in time.
        let client = ClusterClientBuilder::new(infos)
            .connection_timeout((timeout / 4).max(Duration::from_millis(1)))
            .response_timeout(timeout)
            .retries(RETRIES)
            .min_retry_wait(1)
            .max_retry_wait((ms / 4).max(1))
            .build()
            .map_err(bad)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| TierError::Connect {
                url: shown.clone(),
                reason: format!("cannot start the client runtime: {e}"),
            })?;
        let mut store = Self {
            runtime,
            client,
            conn: None,
            timeout,
            seeds: shown,
            secrets,
        };
        store.connection(Instant::now() + timeout)?;
        Ok(store)
    }

    /// The connection, made first if there is none, by `deadline`.
    fn connection(&mut self, deadline: Instant) -> Result<ClusterConnection, TierError> {
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let client = &self.client;
        let conn = self
            .runtime
            .block_on(async { timeout_at(deadline, client.get_async_connection()).await })
            .map_err(|_| TierError::Timeout {
                op: "connect",
                timeout_ms: millis(self.timeout),
            })?
            .map_err(|e| {
                // The client gives up on a slow node at its own connection timeout, before
                // the call's deadline: that is a timeout as much as the deadline is.
                if e.is_timeout() {
                    TierError::Timeout {
                        op: "connect",
                        timeout_ms: millis(self.timeout),
                    }
                } else {
                    TierError::Connect {
                        url: self.seeds.clone(),
                        reason: scrub(&e.to_string(), &self.secrets),
                    }
                }
            })?;
        self.conn = Some(conn.clone());
        Ok(conn)
    }

    /// Sends `cmds` at once and waits for all answers until the deadline.
    fn batch<T>(
        &mut self,
        op: &'static str,
        cmds: Vec<Cmd>,
        parse: fn(Value) -> Result<T, String>,
    ) -> Vec<Result<T, TierError>> {
        if cmds.is_empty() {
            return Vec::new();
        }
        // One deadline for the whole call, reconnecting included.
        let deadline = Instant::now() + self.timeout;
        let conn = match self.connection(deadline) {
            Ok(c) => c,
            Err(e) => return cmds.iter().map(|_| Err(e.clone())).collect(),
        };
        let answers = self
            .runtime
            .block_on(futures_util::future::join_all(cmds.into_iter().map(
                |cmd| {
                    let mut conn = conn.clone();
                    async move { timeout_at(deadline, cmd.query_async::<Value>(&mut conn)).await }
                },
            )));
        let timeout_ms = millis(self.timeout);
        let mut broken = false;
        let out = answers
            .into_iter()
            .map(|answer| match answer {
                Err(_) => {
                    broken = true;
                    Err(TierError::Timeout { op, timeout_ms })
                }
                Ok(Err(e)) if e.is_timeout() => {
                    broken = true;
                    Err(TierError::Timeout { op, timeout_ms })
                }
                Ok(Err(e)) => {
                    broken = true;
                    Err(TierError::Store {
                        op,
                        reason: scrub(&e.to_string(), &self.secrets),
                    })
                }
                Ok(Ok(v)) => parse(v).map_err(|reason| TierError::Store { op, reason }),
            })
            .collect();
        if broken {
            // The client may still route to a node that died or lost its slots; a fresh
            // connection reads the topology again before the next call.
            self.conn = None;
        }
        out
    }
}

impl RemoteStore for RedisStore {
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
        let cmds = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("EXISTS");
                c.arg(k.as_str());
                c
            })
            .collect();
        self.batch("exists", cmds, |v| match v {
            Value::Int(n) => Ok(n > 0),
            other => Err(format!("EXISTS answered {other:?}")),
        })
    }

    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let cmds = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("GET");
                c.arg(k.as_str());
                c
            })
            .collect();
        self.batch("get", cmds, |v| match v {
            Value::Nil => Ok(None),
            Value::BulkString(bytes) => Ok(Some(bytes)),
            other => Err(format!("GET answered {}", kind(&other))),
        })
    }

    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
        let cmds = entries
            .iter()
            .map(|(k, v)| {
                let mut c = redis::cmd("SET");
                c.arg(k.as_str()).arg(v.as_slice());
                c
            })
            .collect();
        self.batch("put", cmds, |v| match v {
            Value::Okay => Ok(()),
            other => Err(format!("SET answered {}", kind(&other))),
        })
    }

    fn describe(&self) -> String {
        format!("Redis Cluster {}", self.seeds)
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Int(_) => "an integer",
        Value::BulkString(_) => "a bulk string",
        Value::Array(_) => "an array",
        Value::SimpleString(_) => "a simple string",
        Value::Okay => "OK",
        _ => "an unexpected type",
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Parses one seed URL; only TCP (`redis://`) and TLS (`rediss://`) are accepted.
pub(crate) fn parse_seed(seed: &str) -> Result<ConnectionInfo, TierError> {
    let bad = |reason: String| TierError::BadUrl {
        url: redact_url(seed),
        reason,
    };
    let lower = seed.trim().to_ascii_lowercase();
    if !(lower.starts_with("redis://") || lower.starts_with("rediss://")) {
        return Err(bad("must start with redis:// or rediss://".into()));
    }
    seed.trim()
        .into_connection_info()
        .map_err(|e| bad(scrub(&e.to_string(), &password_of(seed))))
}

fn password_of(url: &str) -> Vec<String> {
    userinfo(url)
        .and_then(|(_, info)| info.split_once(':').map(|(_, pw)| pw.to_string()))
        .filter(|pw| !pw.is_empty())
        .into_iter()
        .collect()
}

/// `(offset of the userinfo, userinfo)` of a URL, if it has one.
fn userinfo(url: &str) -> Option<(usize, &str)> {
    let start = url.find("://")? + 3;
    let rest = &url[start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = rest[..authority_end].rfind('@')?;
    Some((start, &rest[..at]))
}

/// `url` with its password replaced by `***` (the user name is kept: it tells which ACL
/// user was refused).
///
/// # Examples
/// ```
/// use offload_core::tier::redact_url;
///
/// assert_eq!(redact_url("redis://app:s3cret@10.0.0.1:6379"), "redis://app:***@10.0.0.1:6379");
/// assert_eq!(redact_url("rediss://:s3cret@cache:6380/0"), "rediss://:***@cache:6380/0");
/// assert_eq!(redact_url("redis://cache:6379"), "redis://cache:6379");
/// ```
pub fn redact_url(url: &str) -> String {
    match userinfo(url) {
        Some((start, info)) => {
            let user = info.split_once(':').map_or(info, |(u, _)| u);
            let shown = if info.contains(':') {
                format!("{user}:***")
            } else {
                user.to_string()
            };
            format!("{}{shown}{}", &url[..start], &url[start + info.len()..])
        }
        None => url.to_string(),
    }
}

/// `text` with every secret masked, for messages built from the client's errors.
fn scrub(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .filter(|s| !s.is_empty())
        .fold(text.to_string(), |t, s| t.replace(s.as_str(), "***"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_tcp_and_tls_urls_are_seeds() {
        assert!(parse_seed("redis://127.0.0.1:7000").is_ok());
        assert!(parse_seed("rediss://user:pw@cache.example:6380").is_ok());
        for bad in [
            "unix:///tmp/redis.sock",
            "http://x:1",
            "127.0.0.1:7000",
            "redis://",
        ] {
            assert!(parse_seed(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn errors_never_show_the_password() {
        let err = parse_seed("redis://u:topsecret@[not-a-host").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains("topsecret"), "{msg}");
        assert!(msg.contains("u:***@"), "{msg}");
        assert_eq!(redact_url("redis://onlyuser@h:1"), "redis://onlyuser@h:1");
        // An '@' after the authority is not a userinfo separator.
        assert_eq!(redact_url("redis://h:1/0#a:b@c"), "redis://h:1/0#a:b@c");
    }
}
