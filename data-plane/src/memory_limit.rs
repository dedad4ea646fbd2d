//! The memory limit of the stage's container (its memory cgroup), checked
//! at start against `--memory-budget`: a budget the limit cannot hold gets
//! the stage killed by the kernel as soon as its buffers fill, with no word
//! from the stage; a warning at start says why beforehand.

use std::path::Path;

/// What the stage holds beyond its budget at the least (see
/// docs/data-plane.md, "Memory"): the chart's sizing rule.
pub const OVERHEAD: u64 = 64 << 20;

/// The memory limit of the stage's cgroup (v2 `memory.max`, or v1
/// `memory.limit_in_bytes`); `None` when there is none or it cannot be read.
pub fn container() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    limit_of(&cgroups, Path::new("/sys/fs/cgroup"))
}

/// The limit that `cgroups` (the text of `/proc/self/cgroup`) names under
/// `root`; a cgroup path that is not there (a cgroup namespace) is read at
/// the root of the hierarchy.
fn limit_of(cgroups: &str, root: &Path) -> Option<u64> {
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let path = path.trim_start_matches('/');
        let (dir, file) = match controllers {
            "" => (root.to_path_buf(), "memory.max"),
            c if c.split(',').any(|c| c == "memory") => {
                (root.join("memory"), "memory.limit_in_bytes")
            }
            _ => continue,
        };
        let read = |dir: &Path| std::fs::read_to_string(dir.join(file)).ok();
        let Some(text) = read(&dir.join(path)).or_else(|| read(&dir)) else {
            continue;
        };
        // `max` (v2), or v1's page-rounded "no limit".
        return text
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&limit| limit < 1 << 60);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_read_from_either_hierarchy() {
        let root = tempfile::tempdir().unwrap();
        let v2 = root.path().join("kubepods/pod1");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "1342177280\n").unwrap();
        assert_eq!(
            limit_of("0::/kubepods/pod1\n", root.path()),
            Some(1_342_177_280)
        );
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        assert_eq!(limit_of("0::/kubepods/pod1\n", root.path()), None);
        // v1, and a path the namespace hides: the hierarchy's root.
        let v1 = root.path().join("memory");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "335544320\n").unwrap();
        let text = "12:cpu,cpuacct:/x\n7:memory:/not/here\n0::/\n";
        assert_eq!(limit_of(text, root.path()), Some(335_544_320));
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(limit_of(text, root.path()), None);
    }
}
