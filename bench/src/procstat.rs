//! CPU time and memory of the proxy processes, from /proc.

use std::time::Duration;

/// One reading of a process.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reading {
    /// utime + stime.
    pub cpu: Duration,
    /// VmRSS, KiB.
    pub rss_kib: u64,
    /// VmHWM (peak RSS since start or since the last `reset_peak`), KiB.
    pub hwm_kib: u64,
    /// RssAnon: heap and stacks, without the mapped binary (RssFile), KiB.
    pub anon_kib: u64,
}

/// Reads /proc/<pid>/stat and /proc/<pid>/status; None once the process is gone.
pub fn read(pid: u32) -> Option<Reading> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is parenthesised and may hold spaces: count fields after it.
    // utime and stime are fields 14 and 15 of the line, the 12th and 13th after ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()??
        .max(1) as u64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Some(Reading {
        cpu: Duration::from_micros(ticks * 1_000_000 / hz),
        rss_kib: kib("VmRSS:"),
        hwm_kib: kib("VmHWM:"),
        anon_kib: kib("RssAnon:"),
    })
}

/// Resets VmHWM to the current RSS (clear_refs value 5, Linux >= 4.0), so each scenario
/// gets its own peak.
pub fn reset_peak(pid: u32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
}
