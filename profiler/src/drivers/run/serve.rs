//! `run`'s /metrics server, and finding its target by name.

use super::*;

pub(super) async fn start_metrics(
    config: &Config,
    snapshot: &Arc<Mutex<Snapshot>>,
) -> anyhow::Result<crate::background::Background> {
    serve_metrics(bind_metrics(config).await?, config, snapshot)
}

pub(super) async fn bind_metrics(config: &Config) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(config.metrics_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} for /metrics (metrics.listen): is another slotprof running? choose \
                 another port",
                config.metrics_listen
            )
        })
}

pub(super) fn serve_metrics(
    listener: tokio::net::TcpListener,
    config: &Config,
    snapshot: &Arc<Mutex<Snapshot>>,
) -> anyhow::Result<crate::background::Background> {
    eprintln!("slotprof: metrics on http://{}/metrics", listener.local_addr()?);
    Ok(metrics::serve_in_background(
        listener,
        snapshot.clone(),
        config.export_dir.clone(),
    )?)
}

/// The process to profile: by pid, or the oldest process with this name
/// (its main thread's comm, or its executable's file name).
pub(super) fn find_target(spec: &TargetSpec) -> Result<Target, String> {
    match spec {
        TargetSpec::Pid(p) => Target::from_pid(*p).map_err(|e| format!("{e:#}")),
        TargetSpec::Comm(c) => {
            let mut found: Vec<(u64, u32)> = Vec::new();
            for e in std::fs::read_dir("/proc").map_err(|e| e.to_string())?.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
                let exe_name = exe.as_ref().and_then(|e| e.file_name()).and_then(|n| n.to_str());
                if !names_match(c, comm.trim_end(), exe_name) || pid == std::process::id() {
                    continue;
                }
                let start = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| {
                        s.rsplit_once(") ")
                            .and_then(|(_, r)| r.split_whitespace().nth(19)?.parse().ok())
                    })
                    .unwrap_or(u64::MAX);
                found.push((start, pid));
            }
            let (_, pid) = found
                .into_iter()
                .min()
                .ok_or_else(|| format!("no process named {c:?} is running (target.comm)"))?;
            Target::from_pid(pid).map_err(|e| format!("{e:#}"))
        }
    }
}

/// Whether a process is the one `target.comm` names: its comm (which the
/// kernel cuts to 15 bytes: `solana-test-validator` runs as
/// `solana-test-val`, so a longer name matches on its first 15), or its
/// executable's file name.
pub(super) fn names_match(wanted: &str, comm: &str, exe_name: Option<&str>) -> bool {
    const COMM_MAX: usize = 15;
    let comm_matches = comm == wanted
        || (wanted.len() > COMM_MAX
            && comm.len() == COMM_MAX
            && wanted.as_bytes().starts_with(comm.as_bytes()));
    comm_matches || exe_name == Some(wanted)
}

#[cfg(test)]
mod target_name_tests {
    use super::names_match;

    #[test]
    fn a_name_longer_than_comm_matches_on_its_first_fifteen_bytes() {
        // solana-test-validator runs with comm "solana-test-val".
        assert!(names_match("solana-test-validator", "solana-test-val", None));
        assert!(names_match("agave-validator", "agave-validator", None));
        assert!(names_match(
            "solana-test-validator",
            "x",
            Some("solana-test-validator")
        ));
        // A short comm is not a prefix match, nor is a different 15 bytes.
        assert!(!names_match("solana-test-validator", "solana", None));
        assert!(!names_match("solana-test-validator", "solana-test-vax", None));
        assert!(!names_match("agave", "agave-validator", None));
    }
}
