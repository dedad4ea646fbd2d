//! A process's file descriptor limit: raised to what the system allows at
//! start (the soft limit is often 1024 while the hard one is far higher,
//! and every open sample, cache file and connection takes one), and split
//! so that connections cannot take the descriptors the rest needs (a
//! stage's reads, a controller's store).

#![allow(unsafe_code)]

/// Raises the soft limit on open descriptors to the hard one (at most
/// 2^20), and returns the limit in force afterwards.
pub fn raise() -> usize {
    let Some(mut limit) = current() else {
        return FALLBACK;
    };
    let wanted = limit.rlim_max.min(1 << 20);
    if limit.rlim_cur < wanted {
        let raised = libc::rlimit {
            rlim_cur: wanted,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) } == 0 {
            limit = raised;
        }
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}

/// The most connections one listener holds at once: a quarter of the
/// descriptors the process may still open (its limit less those it holds
/// when asked, at start once its own are open), so that the rest keeps
/// the others (a stage's data files, node cache, mount and `/metrics`; a
/// floor above that, or a quarter of the whole limit, under a low limit
/// let accepted connections take every descriptor their reads needed).
pub fn connections_per_listener() -> usize {
    per_listener(soft().saturating_sub(held().unwrap_or(0)))
}

/// Descriptors the process holds now (`None` where `/proc` does not say).
fn held() -> Option<usize> {
    let listed = std::fs::read_dir("/proc/self/fd").ok()?.count();
    // The listing's own descriptor is among those it lists.
    Some(listed.saturating_sub(1))
}

/// The descriptors the process may open now (the soft limit).
pub fn soft() -> usize {
    current().map_or(FALLBACK, |l| {
        usize::try_from(l.rlim_cur).unwrap_or(usize::MAX)
    })
}

/// Whether `e` says the process (`EMFILE`) or the system (`ENFILE`) is out
/// of file descriptors, itself or as an [`Exhausted`] that says so: a
/// shortage that passes as others close theirs.
pub fn exhausted(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
        || e.get_ref().is_some_and(|inner| inner.is::<Exhausted>())
}

/// An error that says, in its own words, that the process found no file
/// descriptor free (it waited for one, say): still [`exhausted`].
#[derive(Debug)]
pub struct Exhausted(pub String);

impl std::fmt::Display for Exhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Exhausted {}

fn per_listener(soft: usize) -> usize {
    (soft / 4).max(1)
}

/// The limit assumed where the system does not say.
const FALLBACK: usize = 1024;

fn current() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } == 0).then_some(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortage_said_in_other_words_is_still_one() {
        assert!(exhausted(&std::io::Error::from_raw_os_error(libc::EMFILE)));
        assert!(exhausted(&std::io::Error::from_raw_os_error(libc::ENFILE)));
        let said = std::io::Error::other(Exhausted("no descriptor for 10 s".into()));
        assert!(exhausted(&said));
        assert_eq!(said.to_string(), "no descriptor for 10 s");
        assert!(!exhausted(&std::io::Error::from_raw_os_error(libc::EACCES)));
        assert!(!exhausted(&std::io::Error::other("Too many open files")));
    }

    #[test]
    fn connections_keep_three_quarters_of_the_limit_for_reads() {
        let limit = raise();
        assert!(limit >= 64);
        let most = connections_per_listener();
        let held = held().expect("/proc says");
        assert!(held >= 3, "stdin, stdout and stderr at least: {held}");
        assert!(
            most >= 16 && most <= (limit - held) / 4,
            "{most} of {limit}"
        );
        // Under a low limit too: the other three quarters stay free.
        assert_eq!(per_listener(64), 16);
        assert_eq!(per_listener(3), 1);
    }
}
