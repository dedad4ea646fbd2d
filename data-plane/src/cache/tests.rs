use super::*;
use crate::metrics::Metrics;
use crate::plan::permutation;

fn cache(capacity: u64, policy: CachePolicy) -> Arc<Cache> {
    let tiers = Tiers {
        memory: capacity,
        policy,
        disk: None,
    };
    Cache::new(&tiers, &[], Metrics::new().cache.clone()).unwrap()
}

/// What each data set holds in memory: (bytes, entries), by name.
fn usage(c: &Cache) -> Vec<(u64, u64)> {
    c.report()
        .datasets
        .iter()
        .map(|d| (d.bytes, d.entries))
        .collect()
}

fn key(source: &Arc<str>, name: &str, size: u64) -> SampleKey {
    SampleKey {
        source: Arc::clone(source),
        name: name.into(),
        version: 1,
        size,
    }
}

/// Looks `key` up and, on a miss, fills it with `size` bytes of `fill`;
/// returns whether it hit.
fn read(c: &Arc<Cache>, dataset: &str, key: &SampleKey, fill: u8) -> bool {
    match lookup(c, dataset, key) {
        Lookup::Hit(bytes) => {
            assert_eq!(bytes.len() as u64, key.size);
            true
        }
        Lookup::Miss(f) => {
            f.complete(&vec![fill; key.size as usize]);
            false
        }
        Lookup::Wait(_) => panic!("nothing else reads"),
        Lookup::Disk(_) => unreachable!("read by `lookup`"),
    }
}

/// [`Cache::lookup`], with a disk hit read as a trainer's reader reads it
/// (into a buffer of its own), and looked up again when the file failed.
fn lookup(c: &Arc<Cache>, dataset: &str, key: &SampleKey) -> Lookup {
    loop {
        match c.lookup(dataset, key) {
            Lookup::Disk(hit) => {
                let mut buf = vec![0; hit.len()];
                if hit.read_into(&mut buf) {
                    return Lookup::Hit(buf.into());
                }
            }
            other => return other,
        }
    }
}

/// Hits over `epochs` epochs of `n` samples of `size` bytes in a fresh
/// random order each, after a first epoch that fills the cache.
fn hits_per_epoch(policy: CachePolicy, capacity: u64, n: u32, size: u64, epochs: u64) -> Vec<u32> {
    let c = cache(capacity, policy);
    let src: Arc<str> = "/data".into();
    (0..=epochs)
        .map(|epoch| {
            permutation(n, 7, epoch, true)
                .into_iter()
                .filter(|&i| read(&c, "d", &key(&src, &format!("f{i}"), size), 0))
                .count() as u32
        })
        .collect()
}

#[test]
fn a_hit_returns_the_bytes_and_a_new_version_misses() {
    let c = cache(1 << 20, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 3);
    assert!(!read(&c, "d", &k, 7));
    let Lookup::Hit(bytes) = lookup(&c, "d", &k) else {
        panic!("admitted");
    };
    assert_eq!(&bytes[..], &[7, 7, 7]);
    let changed = SampleKey { version: 2, ..k };
    assert!(!read(&c, "d", &changed, 8), "a new version is a new key");
}

#[test]
fn a_data_set_that_fits_hits_every_read_after_the_first_epoch() {
    let hits = hits_per_epoch(CachePolicy::Stable, 100 * 10, 100, 10, 3);
    assert_eq!(hits, vec![0, 100, 100, 100]);
}

#[test]
fn the_stable_policy_keeps_its_subset_and_hits_the_optimum_where_lru_thrashes() {
    // A quarter of the data set fits: the best any cache can do under
    // random order is 25% of reads.
    let (n, size) = (2000, 10);
    let stable = hits_per_epoch(CachePolicy::Stable, 500 * size, n, size, 4);
    assert_eq!(
        &stable[1..],
        &[500, 500, 500, 500],
        "exactly the subset, every epoch"
    );
    let lru = hits_per_epoch(CachePolicy::Lru, 500 * size, n, size, 4);
    let lru_mean = lru[1..].iter().sum::<u32>() as f64 / 4.0;
    assert!(
        lru_mean < 0.8 * 500.0,
        "LRU hit {lru:?}, about chance or below"
    );
}

#[test]
fn a_second_data_set_takes_its_share_from_the_first() {
    let c = cache(100, CachePolicy::Stable);
    let (a, b): (Arc<str>, Arc<str>) = ("/a".into(), "/b".into());
    for i in 0..10 {
        read(&c, "a", &key(&a, &format!("f{i}"), 10), 0);
    }
    assert_eq!(usage(&c)[0].0, 100, "a alone may fill the cache");
    for i in 0..10 {
        read(&c, "b", &key(&b, &format!("f{i}"), 10), 0);
    }
    let held = usage(&c);
    assert_eq!((held[0].0, held[1].0), (50, 50), "{held:?}");
    // a kept its oldest half: the subset it already had.
    for i in 0..5 {
        assert!(read(&c, "a", &key(&a, &format!("f{i}"), 10), 0), "f{i}");
    }
    // Weights split the cache unevenly.
    c.set_weight(&a, "a", 3);
    for i in 5..10 {
        read(&c, "a", &key(&a, &format!("f{i}"), 10), 0);
    }
    let held = usage(&c);
    assert_eq!((held[0].0, held[1].0), (70, 30), "{held:?}");
}

/// The memory share of each data set now, by name.
fn shares(c: &Cache) -> Vec<(String, u64)> {
    c.report()
        .datasets
        .into_iter()
        .map(|d| (d.dataset, d.share_bytes))
        .collect()
}

fn terms(tenant: &str, tenant_weight: u32, weight: u32, pin: u64) -> Option<Terms> {
    Some(Terms {
        tenant: tenant.into(),
        tenant_weight,
        weight,
        pin,
    })
}

#[test]
fn tenants_split_the_cache_first_then_their_data_sets() {
    let c = cache(1200, CachePolicy::Stable);
    let (a, b, x): (Arc<str>, Arc<str>, Arc<str>) = ("/a".into(), "/b".into(), "/x".into());
    c.steer(&a, "a", terms("vision", 2, 1, 0), None);
    c.steer(&b, "b", terms("vision", 2, 3, 0), None);
    c.steer(&x, "x", terms("text", 1, 1, 0), None);
    // Nobody has read them yet: the room is anyone's.
    assert_eq!(
        shares(&c),
        [("a".into(), 0), ("b".into(), 0), ("x".into(), 0)]
    );
    for (s, n) in [(&a, "a"), (&b, "b"), (&x, "x")] {
        drop(c.lookup(n, &key(s, "f", 1)));
    }
    // vision gets 2/3 (800), split 1:3 between a and b; text gets 400.
    assert_eq!(
        shares(&c),
        [("a".into(), 200), ("b".into(), 600), ("x".into(), 400)]
    );
    // Back to the stage's own terms: three data sets of weight 1.
    for (s, n) in [(&a, "a"), (&b, "b"), (&x, "x")] {
        c.steer(s, n, None, None);
    }
    assert_eq!(
        shares(&c),
        [("a".into(), 400), ("b".into(), 400), ("x".into(), 400)]
    );
}

#[test]
fn a_pin_is_kept_whatever_the_others_read() {
    let c = cache(100, CachePolicy::Stable);
    let (p, o): (Arc<str>, Arc<str>) = ("/p".into(), "/o".into());
    c.steer(&p, "p", terms("", 1, 1, 60), None);
    for i in 0..6 {
        read(&c, "p", &key(&p, &format!("f{i}"), 10), 0);
    }
    // The other data set fills the rest and more: the pinned 60 stay.
    for epoch in 0..3 {
        for i in 0..20 {
            read(&c, "o", &key(&o, &format!("f{i}-{epoch}"), 10), 0);
        }
    }
    let held = usage(&c);
    assert_eq!(held[1].0, 60, "{held:?}");
    assert_eq!(held[0].0, 40, "{held:?}");
    for i in 0..6 {
        assert!(read(&c, "p", &key(&p, &format!("f{i}"), 10), 0), "f{i}");
    }
    // Pins larger than the tier are scaled down together.
    c.steer(&o, "o", terms("", 1, 1, PIN_ALL), None);
    c.steer(&p, "p", terms("", 1, 1, PIN_ALL), None);
    assert_eq!(shares(&c), [("o".into(), 50), ("p".into(), 50)]);
}

#[test]
fn a_pin_of_all_keeps_what_the_pins_of_a_size_leave() {
    let c = cache(100, CachePolicy::Stable);
    let (a, b, x): (Arc<str>, Arc<str>, Arc<str>) = ("/a".into(), "/b".into(), "/x".into());
    // `all` of a 30-byte data set beside a 10-byte pin: both kept whole,
    // and what is left goes by weight to the data sets read lately.
    c.steer(&a, "a", terms("", 1, 1, PIN_ALL), Some(30));
    c.steer(&b, "b", terms("", 1, 1, 10), None);
    c.steer(&x, "x", terms("", 1, 1, 0), None);
    read(&c, "x", &key(&x, "f", 1), 0);
    assert_eq!(
        shares(&c),
        [("a".into(), 30), ("b".into(), 10), ("x".into(), 60)]
    );
    // A data set of unknown size takes what the sized pins leave; a sized
    // pin is never cut for it.
    let c2 = cache(100, CachePolicy::Stable);
    c2.steer(&a, "a", terms("", 1, 1, PIN_ALL), None);
    c2.steer(&b, "b", terms("", 1, 1, 10), None);
    assert_eq!(shares(&c2), [("a".into(), 90), ("b".into(), 10)]);
}

#[test]
fn a_sample_larger_than_the_cache_is_passed_through() {
    let c = cache(10, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    assert!(!read(&c, "d", &key(&src, "big", 11), 0));
    assert!(!read(&c, "d", &key(&src, "big", 11), 0));
    assert_eq!(usage(&c)[0].1, 0);
}

#[test]
fn concurrent_misses_of_one_sample_share_one_read() {
    let c = cache(1 << 20, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 4);
    let Lookup::Miss(fill) = c.lookup("d", &k) else {
        panic!("first lookup misses");
    };
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let Lookup::Wait(flight) = c.lookup("d", &k) else {
                panic!("a read is in flight");
            };
            std::thread::spawn(move || flight.wait_blocking())
        })
        .collect();
    let Lookup::Wait(flight) = c.lookup("d", &k) else {
        panic!("a read is in flight");
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let waited = runtime.spawn(async move { flight.wait().await });
    fill.complete(&[1, 2, 3, 4]);
    for w in waiters {
        assert_eq!(&w.join().unwrap().unwrap()[..], &[1, 2, 3, 4]);
    }
    assert_eq!(
        &runtime.block_on(waited).unwrap().unwrap()[..],
        &[1, 2, 3, 4]
    );
}

#[test]
fn a_failed_read_fails_its_waiters_and_leaves_nothing_pending() {
    let c = cache(1 << 20, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 4);
    let Lookup::Miss(fill) = c.lookup("d", &k) else {
        panic!("first lookup misses");
    };
    let Lookup::Wait(flight) = c.lookup("d", &k) else {
        panic!("a read is in flight");
    };
    fill.fail(&ProtocolError::new(ErrorCode::NotFound, "gone"));
    assert_eq!(
        flight.wait_blocking().unwrap_err().code,
        ErrorCode::NotFound
    );
    assert!(
        matches!(c.lookup("d", &k), Lookup::Miss(_)),
        "nothing pending any more"
    );
}

/// A cache of `memory` bytes with a disk tier of `disk` bytes in `dir`,
/// serving source `/data` (dataset `d`).
fn tiered(dir: &std::path::Path, memory: u64, disk: u64) -> Arc<Cache> {
    open_tiered(dir, memory, disk, ("/data", "d")).unwrap()
}

/// A stable cache with a disk tier in `dir`, serving `(source, dataset)`.
fn open_tiered(
    dir: &std::path::Path,
    memory: u64,
    disk: u64,
    (source, dataset): (&str, &str),
) -> std::io::Result<Arc<Cache>> {
    let tiers = Tiers {
        memory,
        policy: CachePolicy::Stable,
        disk: Some((dir.to_owned(), disk)),
    };
    Cache::new(
        &tiers,
        &[(source.into(), dataset.into())],
        Metrics::new().cache.clone(),
    )
}

/// What one small sample's file takes on the disk tier.
const FILE: u64 = 4096;

/// Waits until the disk tier holds `entries` samples.
fn on_disk(c: &Cache, entries: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Entries count once their files are written, not when they are queued.
    let written = || {
        let st = lock(&c.state);
        st.disk.as_ref().map_or(0, |d| d.tier.count(|f| f.ready)) as u64
    };
    // ... and once the writer's queue is empty (what it will not keep is
    // served from the queue until then).
    while written() < entries || !lock(&c.state).queued.samples.is_empty() {
        assert!(std::time::Instant::now() < deadline, "{:?}", c.report());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn what_memory_does_not_keep_goes_to_disk_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    {
        let c = tiered(dir.path(), 30, 10 * FILE);
        for i in 0..10 {
            assert!(!read(&c, "d", &key(&src, &format!("f{i}"), 10), i as u8));
        }
        on_disk(&c, 7);
        let report = c.report();
        assert_eq!(
            (report.used_bytes, report.disk_used_bytes),
            (30, 7 * FILE),
            "{report:?}"
        );
        let Lookup::Hit(bytes) = lookup(&c, "d", &key(&src, "f9", 10)) else {
            panic!("f9 is on disk");
        };
        assert_eq!(&bytes[..], &[9; 10]);
    }
    // A new stage finds what the last one left, and only that; it removes
    // files named as its own that it cannot use, and nothing else.
    let torn = dir.path().join("ab").join(format!("ab{}", "0".repeat(30)));
    std::fs::create_dir_all(torn.parent().unwrap()).unwrap();
    std::fs::write(&torn, b"SLUICE1\ntorn").unwrap();
    std::fs::create_dir_all(dir.path().join("zz")).unwrap();
    std::fs::write(dir.path().join("zz").join("notes"), b"not ours").unwrap();
    let c = tiered(dir.path(), 30, 10 * FILE);
    assert_eq!(c.report().disk_used_bytes, 7 * FILE);
    assert!(!torn.exists());
    assert!(dir.path().join("zz").join("notes").exists());
    for i in 3..10 {
        assert!(read(&c, "d", &key(&src, &format!("f{i}"), 10), 0), "f{i}");
    }
}

#[test]
fn disk_files_spread_over_the_subdirectories_and_old_names_move() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    // Names that differ only at their end, as data sets name files: 400 of
    // them hashed evenly fill about 200 of the 256 subdirectories.
    let subdirs: std::collections::HashSet<_> = (0..400)
        .map(|i| {
            let path = disk::path_of(dir.path(), &key(&src, &format!("f{i:04}"), 10));
            path.parent().unwrap().to_owned()
        })
        .collect();
    assert!(subdirs.len() > 160, "{} subdirectories", subdirs.len());
    // A file a stage left under another of the tier's names (an earlier
    // release's) is kept, under its name now.
    {
        let c = tiered(dir.path(), 0, 10 * FILE);
        assert!(!read(&c, "d", &key(&src, "f1", 10), 1));
        on_disk(&c, 1);
    }
    let named = disk::path_of(dir.path(), &key(&src, "f1", 10));
    let old = dir.path().join("00").join(format!("00{}", "1".repeat(30)));
    std::fs::create_dir_all(old.parent().unwrap()).unwrap();
    std::fs::rename(&named, &old).unwrap();
    let c = tiered(dir.path(), 0, 10 * FILE);
    assert!(named.exists() && !old.exists());
    assert!(
        read(&c, "d", &key(&src, "f1", 10), 0),
        "kept across the move"
    );
}

#[test]
fn a_damaged_disk_file_is_a_miss_and_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let c = tiered(dir.path(), 0, 10 * FILE);
    let k = key(&src, "a", 100);
    assert!(!read(&c, "d", &k, 1));
    // A flipped bit of the bytes; a flipped bit of the length in the
    // header (the third of the four words that end it), which must not
    // be allocated for (a terabyte here).
    let damages: [fn(&mut Vec<u8>); 2] = [
        |b| *b.last_mut().unwrap() ^= 0xff,
        |b| {
            let at = b.len() - 100 - 16;
            b[at + 5] ^= 0x01;
        },
    ];
    let path = disk::path_of(dir.path(), &k);
    for damage in damages {
        on_disk(&c, 1);
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes);
        std::fs::write(&path, bytes).unwrap();
        assert!(!read(&c, "d", &k, 2), "a damaged file is not served");
    }
    on_disk(&c, 1);
    assert!(read(&c, "d", &k, 0), "written again whole");
    // A file of another version of the sample is not served for this one.
    let other = SampleKey {
        version: 9,
        ..k.clone()
    };
    assert!(matches!(c.lookup("d", &other), Lookup::Miss(_)));
}

#[test]
fn a_range_of_a_disk_file_is_checked_by_the_blocks_it_touches() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    // Three blocks of checksums: 1 MiB, 1 MiB and 512 KiB.
    let size = (5 << 20) / 2;
    let k = key(&src, "a", size);
    let c = tiered(dir.path(), 0, 8 << 20);
    assert!(!read(&c, "d", &k, 7));
    on_disk(&c, 1);
    // The hit counts the range's bytes, not the sample's.
    assert_eq!(c.peek_range("d", &k, 10, 5), Some(vec![7; 5]));
    assert_eq!(c.report().datasets[0].hit_bytes, 5);
    assert_eq!(c.peek_range("d", &k, size - 2, 5), None, "past the end");
    // A byte flipped in the last block, in the file this cache wrote: a
    // range in the first block is read and served, one across the last
    // is refused and the file dropped.
    let path = disk::path_of(dir.path(), &k);
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(c.peek_range("d", &k, 0, 3), Some(vec![7; 3]));
    assert_eq!(c.peek_range("d", &k, (2 << 20) - 1, 2), None);
    assert!(!path.exists());
    assert!(matches!(lookup(&c, "d", &k), Lookup::Miss(_)));
}

#[test]
fn files_of_the_first_format_are_read_and_checked_whole() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 100);
    drop(tiered(dir.path(), 0, 10 * FILE));
    // What the first release wrote: its header has no block checksums.
    let bytes = vec![5u8; 100];
    let mut file = b"SLUICE1\n".to_vec();
    for part in [k.source.as_bytes(), k.name.as_bytes()] {
        file.extend_from_slice(&(part.len() as u32).to_le_bytes());
        file.extend_from_slice(part);
    }
    for n in [k.version, k.size, 100, disk::checksum(&bytes)] {
        file.extend_from_slice(&n.to_le_bytes());
    }
    file.extend_from_slice(&bytes);
    let path = disk::path_of(dir.path(), &k);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, &file).unwrap();
    let c = tiered(dir.path(), 0, 10 * FILE);
    assert_eq!(c.peek_range("d", &k, 98, 2), Some(vec![5; 2]));
    assert!(read(&c, "d", &k, 0), "read whole");
    drop(c);
    *file.last_mut().unwrap() ^= 0xff;
    std::fs::write(&path, &file).unwrap();
    let c = tiered(dir.path(), 0, 10 * FILE);
    assert_eq!(c.peek_range("d", &k, 0, 2), None);
    assert!(!path.exists());
}

#[test]
fn a_tier_directory_removed_and_made_again_by_another_stage_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    let src: Arc<str> = "/data".into();
    let a = tiered(&tier, 0, 10 * FILE);
    std::fs::remove_dir_all(&tier).unwrap();
    // Another stage takes the path, and holds it.
    std::fs::create_dir(&tier).unwrap();
    let b = tiered(&tier, 0, 10 * FILE);
    assert!(!read(&a, "d", &key(&src, "from-a", 10), 1));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !lock(&a.state).queued.samples.is_empty() {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let listed: Vec<_> = std::fs::read_dir(&tier)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(listed, [disk::MARKER], "the other stage's directory");
    let failed = a.metrics.disk_failures.with_label_values(&["write"]).get();
    assert_eq!(failed, 1, "counted where operators see it");
    drop(b);
    // Removed with nothing made in its place: not made again.
    std::fs::remove_dir_all(&tier).unwrap();
    assert!(!read(&a, "d", &key(&src, "again", 10), 1));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!tier.exists());
}

#[test]
fn the_disk_tier_keeps_a_stable_subset_too() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let c = tiered(dir.path(), 20, 3 * FILE);
    for i in 0..10 {
        read(&c, "d", &key(&src, &format!("f{i}"), 10), 0);
    }
    for _ in 0..2 {
        // What the disk declined is served from the writer's queue until
        // the writer gets to it: count once it has.
        on_disk(&c, 3);
        let hits = (0..10)
            .filter(|i| read(&c, "d", &key(&src, &format!("f{i}"), 10), 0))
            .count();
        assert_eq!(hits, 5, "2 in memory and 3 on disk, every epoch");
    }
}

#[test]
fn a_directory_holding_other_files_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("cats")).unwrap();
    std::fs::write(dir.path().join("cats").join("1.jpg"), b"a cat").unwrap();
    std::fs::write(dir.path().join("notes.txt"), b"keep").unwrap();
    let err = open_tiered(dir.path(), 0, 10 * FILE, ("/data", "d")).unwrap_err();
    assert!(err.to_string().contains("not the node cache's"), "{err}");
    assert_eq!(
        std::fs::read(dir.path().join("cats").join("1.jpg")).unwrap(),
        b"a cat"
    );
    assert_eq!(
        std::fs::read(dir.path().join("notes.txt")).unwrap(),
        b"keep"
    );
    assert!(!dir.path().join(disk::MARKER).exists());
    // A file system's lost+found does not count.
    let fresh = tempfile::tempdir().unwrap();
    std::fs::create_dir(fresh.path().join("lost+found")).unwrap();
    drop(tiered(fresh.path(), 0, FILE));
    assert!(fresh.path().join(disk::MARKER).exists());
    // Nothing but the tier's own files (its marker lost to an `rm -rf`
    // that raced the writer) is a tier's directory; one more file is not.
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 10);
    let c = tiered(fresh.path(), 0, 10 * FILE);
    assert!(!read(&c, "d", &k, 4));
    on_disk(&c, 1);
    drop(c);
    std::fs::remove_file(fresh.path().join(disk::MARKER)).unwrap();
    let sub = disk::path_of(fresh.path(), &k).parent().unwrap().to_owned();
    std::fs::write(sub.join("notes.txt"), b"keep").unwrap();
    assert!(open_tiered(fresh.path(), 0, 10 * FILE, ("/data", "d")).is_err());
    std::fs::remove_file(sub.join("notes.txt")).unwrap();
    let c = tiered(fresh.path(), 0, 10 * FILE);
    assert!(read(&c, "d", &k, 0), "its files found again");
}

#[test]
fn a_second_cache_on_one_directory_is_refused_while_the_first_runs() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let first = tiered(dir.path(), 0, 10 * FILE);
    assert!(!read(&first, "d", &key(&src, "a", 10), 1));
    on_disk(&first, 1);
    let err = open_tiered(dir.path(), 0, 10 * FILE, ("/other", "o")).unwrap_err();
    assert!(
        err.to_string().contains("in use by another sluice-stage"),
        "{err}"
    );
    assert!(
        read(&first, "d", &key(&src, "a", 10), 0),
        "the first one's file is still there"
    );
    drop(first);
    // Once it stopped, the directory is free for the next stage.
    let next = tiered(dir.path(), 0, 10 * FILE);
    assert_eq!(next.report().disk_used_bytes, FILE);
}

/// Version `version` of the 10-byte sample `f{i}` of `source`.
fn versioned(source: &Arc<str>, i: u32, version: u64) -> SampleKey {
    SampleKey {
        version,
        ..key(source, &format!("f{i}"), 10)
    }
}

#[test]
fn an_older_version_of_a_sample_gives_its_room_to_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let versioned = |i: u32, version: u64| versioned(&"/data".into(), i, version);
    // Memory holds 10 samples and disk 5: the data set fits in memory.
    let c = tiered(dir.path(), 100, 5 * FILE);
    for i in 0..10 {
        assert!(!read(&c, "d", &versioned(i, 1), 0));
    }
    // The data set is written again (every file a new version): the first
    // epoch reads it, and from then on it is all cached again.
    for i in 0..10 {
        assert!(!read(&c, "d", &versioned(i, 2), 0));
    }
    let hits = (0..10)
        .filter(|&i| read(&c, "d", &versioned(i, 2), 0))
        .count();
    assert_eq!(hits, 10, "{:?}", c.report());
    assert_eq!(c.report().used_bytes, 100);
}

#[test]
fn an_older_version_left_on_disk_by_a_previous_stage_is_dropped_when_the_new_one_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let versioned = |i: u32, version: u64| versioned(&"/data".into(), i, version);
    {
        let c = tiered(dir.path(), 0, 4 * FILE);
        for i in 0..4 {
            assert!(!read(&c, "d", &versioned(i, 1), 0));
        }
        on_disk(&c, 4);
    }
    let c = tiered(dir.path(), 0, 4 * FILE);
    assert_eq!(c.report().disk_used_bytes, 4 * FILE);
    for i in 0..4 {
        assert!(!read(&c, "d", &versioned(i, 2), 0));
    }
    on_disk(&c, 4);
    let hits = (0..4)
        .filter(|&i| read(&c, "d", &versioned(i, 2), 0))
        .count();
    assert_eq!(hits, 4, "{:?}", c.report());
    let files = walk_files(dir.path());
    assert_eq!(files, 4 + 1, "four samples and the marker: {files}");
}

/// Files beneath `dir`, recursively.
fn walk_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk_files(&e.path())
            } else {
                1
            }
        })
        .sum()
}

#[test]
fn a_disk_tier_whose_directory_went_says_so_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().join("cache");
    let src: Arc<str> = "/data".into();
    // No room in memory: every sample staging keeps goes to disk.
    let c = tiered(&cache_dir, 0, 10 * FILE);
    let first = key(&src, "f0", 10);
    read(&c, "d", &first, 0);
    assert!(c.keep(&first, &[0; 10]).unwrap());
    std::fs::remove_dir_all(&cache_dir).unwrap();
    // A trainer's miss queues its write; staging's keep writes at once (of
    // another sample: the queued write may still be on its way).
    read(&c, "d", &key(&src, "f1", 10), 0);
    let err = c.keep(&key(&src, "f2", 10), &[0; 10]).unwrap_err();
    assert!(err.to_string().contains("SLUICE-CACHE is gone"), "{err}");
    // Nothing was made again without the marker: a restart takes it.
    assert!(!cache_dir.exists());
    drop(c);
    tiered(&cache_dir, 0, 10 * FILE);
}

#[test]
fn staging_keeps_what_memory_does_not_on_disk_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let c = tiered(dir.path(), 20, 3 * FILE);
    let keys: Vec<_> = (0..6).map(|i| key(&src, &format!("f{i}"), 10)).collect();
    let kept: Vec<bool> = keys
        .iter()
        .map(|k| {
            read(&c, "d", k, 0);
            c.keep(k, &[0; 10]).unwrap()
        })
        .collect();
    assert_eq!(
        kept,
        [true, true, true, true, true, false],
        "2 in memory, 3 on disk"
    );
}

#[test]
fn staging_counts_older_versions_as_room() {
    let c = cache(100, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    for i in 0..10 {
        assert!(!read(&c, "d", &versioned(&src, i, 1), 0));
    }
    // Every file written again: the old versions are not the data set's
    // room, so a round stages all of the new ones.
    let (chosen, held, short) = c.to_stage(&src, "d", (0..10).map(|i| (i, versioned(&src, i, 2))));
    assert_eq!((chosen.len(), held, short), (10, 0, false));
    assert_eq!(c.report().used_bytes, 0);
}

#[test]
fn a_full_round_counts_every_sample_held_wherever_it_is_listed() {
    let c = cache(100, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    // Samples 5..10 held (50 bytes), listed after five of 30 bytes.
    for i in 5..10 {
        assert!(!read(&c, "d", &versioned(&src, i, 1), 0));
    }
    let big = |i: u32| {
        (
            i,
            SampleKey {
                size: 30,
                ..versioned(&src, i, 1)
            },
        )
    };
    // 0 fits in the 50 bytes left, 1 does not: the round is short, and
    // the five held after it still count.
    let listing = (0..5)
        .map(big)
        .chain((5..10).map(|i| (i, versioned(&src, i, 1))));
    let (chosen, held, short) = c.to_stage(&src, "d", listing);
    assert_eq!((chosen, held, short), (vec![0], 5, true));
}

#[test]
fn a_marker_with_other_names_is_refused_and_not_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    std::fs::hard_link(&victim, cache.join(disk::MARKER)).unwrap();
    let err = open_tiered(&cache, 0, FILE, ("/data", "d")).unwrap_err();
    assert!(err.to_string().contains("hard links"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
}

#[test]
fn a_sample_on_its_way_to_disk_is_a_hit_not_a_second_read() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    // No memory: every sample goes to disk through the writer's queue.
    let c = tiered(dir.path(), 0, 200 * FILE);
    for i in 0..100 {
        let k = key(&src, &format!("f{i}"), 10);
        assert!(!read(&c, "d", &k, 1));
        // At once, as another job would: queued or written, never missed.
        assert!(read(&c, "d", &k, 2), "f{i} was read from the source twice");
    }
}

#[test]
fn the_disk_writers_queue_is_bounded_in_bytes() {
    let source: Arc<str> = Arc::from("/data");
    let big: Arc<[u8]> = vec![0u8; 20 << 20].into();
    let mut q = Queued::default();
    assert!(q.insert(&key(&source, "a", 20 << 20), &big));
    assert!(
        !q.insert(&key(&source, "b", 20 << 20), &big),
        "40 MiB waiting"
    );
    q.remove(&key(&source, "a", 20 << 20));
    assert_eq!(q.bytes, 0);
    // One sample larger than the bound is queued alone.
    let huge: Arc<[u8]> = vec![0u8; 40 << 20].into();
    assert!(q.insert(&key(&source, "c", 40 << 20), &huge));
    assert!(!q.insert(&key(&source, "d", 1), &Arc::from(&b"x"[..])));
}
