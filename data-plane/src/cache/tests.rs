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
    match c.lookup(dataset, key) {
        Lookup::Hit(bytes) => {
            assert_eq!(bytes.len() as u64, key.size);
            true
        }
        Lookup::Miss(f) => {
            f.complete(&vec![fill; key.size as usize]);
            false
        }
        Lookup::Wait(_) => panic!("nothing else reads"),
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
    let Lookup::Hit(bytes) = c.lookup("d", &k) else {
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
    c.steer(&a, "a", terms("vision", 2, 1, 0));
    c.steer(&b, "b", terms("vision", 2, 3, 0));
    c.steer(&x, "x", terms("text", 1, 1, 0));
    // vision gets 2/3 (800), split 1:3 between a and b; text gets 400.
    assert_eq!(
        shares(&c),
        [("a".into(), 200), ("b".into(), 600), ("x".into(), 400)]
    );
    // Back to the stage's own terms: three data sets of weight 1.
    for (s, n) in [(&a, "a"), (&b, "b"), (&x, "x")] {
        c.steer(s, n, None);
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
    c.steer(&p, "p", terms("", 1, 1, 60));
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
    c.steer(&o, "o", terms("", 1, 1, u64::MAX));
    c.steer(&p, "p", terms("", 1, 1, u64::MAX));
    assert_eq!(shares(&c), [("o".into(), 50), ("p".into(), 50)]);
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
    let tiers = Tiers {
        memory,
        policy: CachePolicy::Stable,
        disk: Some((dir.to_owned(), disk)),
    };
    Cache::new(
        &tiers,
        &[("/data".into(), "d".into())],
        Metrics::new().cache.clone(),
    )
    .unwrap()
}

/// Waits until the disk tier holds `entries` samples.
fn on_disk(c: &Cache, entries: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Entries count once their files are written, not when they are queued.
    let written = || {
        let st = lock(&c.state);
        st.disk.as_ref().map_or(0, |d| d.tier.count(|f| f.ready)) as u64
    };
    while written() < entries {
        assert!(std::time::Instant::now() < deadline, "{:?}", c.report());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn what_memory_does_not_keep_goes_to_disk_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    {
        let c = tiered(dir.path(), 30, 1000);
        for i in 0..10 {
            assert!(!read(&c, "d", &key(&src, &format!("f{i}"), 10), i as u8));
        }
        on_disk(&c, 7);
        let report = c.report();
        assert_eq!(
            (report.used_bytes, report.disk_used_bytes),
            (30, 70),
            "{report:?}"
        );
        let Lookup::Hit(bytes) = c.lookup("d", &key(&src, "f9", 10)) else {
            panic!("f9 is on disk");
        };
        assert_eq!(&bytes[..], &[9; 10]);
    }
    // A new stage finds what the last one left, and only that.
    std::fs::create_dir_all(dir.path().join("zz")).unwrap();
    std::fs::write(dir.path().join("zz").join("stray"), b"not ours").unwrap();
    let c = tiered(dir.path(), 30, 1000);
    assert_eq!(c.report().disk_used_bytes, 70);
    assert!(!dir.path().join("zz").join("stray").exists());
    for i in 3..10 {
        assert!(read(&c, "d", &key(&src, &format!("f{i}"), 10), 0), "f{i}");
    }
}

#[test]
fn a_damaged_disk_file_is_a_miss_and_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let c = tiered(dir.path(), 0, 1000);
    let k = key(&src, "a", 100);
    assert!(!read(&c, "d", &k, 1));
    on_disk(&c, 1);
    let path = disk::path_of(dir.path(), &k);
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    assert!(!read(&c, "d", &k, 2), "a flipped bit is not served");
    assert!(!path.exists() || std::fs::read(&path).unwrap().ends_with(&[2; 100]));
    // A file of another version of the sample is not served for this one.
    let other = SampleKey {
        version: 9,
        ..k.clone()
    };
    assert!(matches!(c.lookup("d", &other), Lookup::Miss(_)));
}

#[test]
fn the_disk_tier_keeps_a_stable_subset_too() {
    let dir = tempfile::tempdir().unwrap();
    let src: Arc<str> = "/data".into();
    let c = tiered(dir.path(), 20, 30);
    for i in 0..10 {
        read(&c, "d", &key(&src, &format!("f{i}"), 10), 0);
    }
    on_disk(&c, 3);
    for _ in 0..2 {
        let hits = (0..10)
            .filter(|i| read(&c, "d", &key(&src, &format!("f{i}"), 10), 0))
            .count();
        assert_eq!(hits, 5, "2 in memory and 3 on disk, every epoch");
    }
}
