//! `sluicectl get pools|policies|jobs|stages|datasets`: one list request, printed
//! as an 80-column table, or as a JSON or YAML array of the [`view`]
//! structs for scripts.
//!
//! [`view`]: crate::view

use serde::Serialize;
use sluice_policy::coordination::PRELOAD_ROUND;
use sluice_proto::v1;

use crate::args::{Format, GetArgs, Listing};
use crate::client::{self, CallError, Controller};
use crate::exit::{self, Exit};
use crate::human;
use crate::table::{Column, TERMINAL_WIDTH, Table};
use crate::view::{
    DatasetOnStageView, DatasetView, JobView, PolicyView, PoolView, StageView, StagingView,
};

/// Runs `get`: asks the controller, prints on stdout.
pub fn run(controller: &Controller, args: &GetArgs) -> Exit {
    match client::block_on(fetch(controller, args.what)) {
        Ok(listed) => {
            exit::say(&listed.render(args.output, human::now_millis()));
            Exit::Ok
        }
        Err(e) => client::report(&e),
    }
}

/// One listing, converted to our own views.
#[derive(Debug)]
pub enum Listed {
    Pools(Vec<PoolView>),
    Policies(Vec<PolicyView>),
    Jobs(Vec<JobView>),
    Stages(Vec<StageView>),
    Datasets(Vec<DatasetView>),
}

/// Asks the controller for one listing.
pub async fn fetch(controller: &Controller, what: Listing) -> Result<Listed, CallError> {
    let mut admin = client::connect(controller).await?;
    let failed = |s| CallError::from_status(&controller.server, s);
    let listed = match what {
        Listing::Pools => {
            let pools = admin.list_pools(v1::ListPoolsRequest {}).await;
            Listed::Pools(views(pools.map_err(failed)?.into_inner().pools))
        }
        Listing::Policies => {
            let request = v1::ListPoliciesRequest {
                include_history: false,
            };
            let policies = admin.list_policies(request).await.map_err(failed)?;
            Listed::Policies(views(policies.into_inner().policies))
        }
        Listing::Jobs => {
            let jobs = admin.list_jobs(v1::ListJobsRequest {}).await;
            Listed::Jobs(views(jobs.map_err(failed)?.into_inner().jobs))
        }
        Listing::Stages => {
            let stages = admin.list_stages(v1::ListStagesRequest {}).await;
            Listed::Stages(views(stages.map_err(failed)?.into_inner().stages))
        }
        Listing::Datasets => {
            let datasets = admin.list_datasets(v1::ListDatasetsRequest {}).await;
            Listed::Datasets(views(datasets.map_err(failed)?.into_inner().datasets))
        }
    };
    Ok(listed)
}

fn views<T, V: From<T>>(items: Vec<T>) -> Vec<V> {
    items.into_iter().map(V::from).collect()
}

impl Listed {
    /// Returns the text to print, ending in a newline.
    pub fn render(&self, format: Format, now_millis: i64) -> String {
        match self {
            Self::Pools(v) => render(v, format, || pools_table(v)),
            Self::Policies(v) => render(v, format, || policies_table(v, now_millis)),
            Self::Jobs(v) => render(v, format, || jobs_table(v)),
            Self::Stages(v) => render(v, format, || stages_table(v, now_millis)),
            Self::Datasets(v) => render(v, format, || datasets_table(v)),
        }
    }
}

fn render<T: Serialize>(items: &[T], format: Format, table: impl FnOnce() -> Table) -> String {
    match format {
        Format::Json => {
            // Serializing plain structs of strings and numbers cannot fail.
            let mut text = serde_json::to_string_pretty(items).unwrap_or_default();
            text.push('\n');
            text
        }
        // The same data as JSON; strings YAML 1.1 readers would take for
        // booleans, numbers or dates quoted (serde's YAML left `yes` plain).
        Format::Yaml => serde_json::to_value(items)
            .map_or_else(|_| String::new(), |v| crate::yaml::to_string(&v)),
        Format::Table => {
            let mut text = table().render(TERMINAL_WIDTH).join("\n");
            text.push('\n');
            text
        }
    }
}

/// `NAME SHARING CAPACITY ALLOCATED THROUGHPUT JOBS`.
pub fn pools_table(pools: &[PoolView]) -> Table {
    let mut t = Table::new(&[
        Column::text("NAME"),
        Column::text("SHARING"),
        Column::whole("CAPACITY"),
        Column::whole("ALLOCATED"),
        Column::whole("THROUGHPUT"),
        Column::whole("JOBS"),
    ]);
    for p in pools {
        t.row(vec![
            p.name.clone(),
            human::or_dash(&p.sharing),
            human::limit(p.bandwidth_bytes_per_second),
            human::rate(p.allocated_bytes_per_second as f64),
            human::rate(p.throughput_bytes_per_second),
            p.jobs.len().to_string(),
        ]);
    }
    t
}

/// `KIND NAME REVISION AGE`.
pub fn policies_table(policies: &[PolicyView], now_millis: i64) -> Table {
    let mut t = Table::new(&[
        Column::whole("KIND"),
        Column::text("NAME"),
        Column::whole("REVISION"),
        Column::whole("AGE"),
    ]);
    for p in policies {
        let revision = if p.deleted {
            format!("{} (deleted)", p.revision)
        } else {
            p.revision.to_string()
        };
        t.row(vec![
            p.kind.clone(),
            p.name.clone(),
            revision,
            human::age(p.created_unix_millis, now_millis),
        ]);
    }
    t
}

/// `ID POLICY POOL THROUGHPUT STALL LIMIT STAGES`.
pub fn jobs_table(jobs: &[JobView]) -> Table {
    let mut t = Table::new(&[
        Column::text("ID"),
        Column::text("POLICY"),
        Column::text("POOL"),
        Column::whole("THROUGHPUT"),
        Column::whole("STALL"),
        Column::whole("LIMIT"),
        Column::whole("STAGES"),
    ]);
    for j in jobs {
        let limit = j.limit_shown();
        t.row(vec![
            j.id.clone(),
            j.policy.clone().unwrap_or_else(|| "-".into()),
            j.pool.clone().unwrap_or_else(|| "-".into()),
            human::rate(j.throughput_bytes_per_second),
            human::percent(j.stall_fraction),
            // A job no stage serves has no limit in force but its cap.
            if j.stages.is_empty() && limit.is_none() {
                "-".to_owned()
            } else {
                human::limit(limit)
            },
            j.stages.len().to_string(),
        ]);
    }
    t
}

/// `ID NODE STATE DESIRED ACKED SYNC JOBS SEEN`.
pub fn stages_table(stages: &[StageView], now_millis: i64) -> Table {
    let mut t = Table::new(&[
        Column::text("ID"),
        Column::text("NODE"),
        Column::whole("STATE"),
        Column::whole("DESIRED"),
        Column::whole("ACKED"),
        Column::whole("SYNC"),
        Column::whole("JOBS"),
        Column::whole("SEEN"),
    ]);
    for s in stages {
        t.row(vec![
            s.id.clone(),
            s.node.clone(),
            s.state.to_owned(),
            s.desired_version.to_string(),
            s.acked_version.to_string(),
            sync_word(s).to_owned(),
            s.jobs.len().to_string(),
            human::age(s.last_seen_unix_millis, now_millis),
        ]);
    }
    t
}

/// `NAME POLICY STAGES CACHED SAMPLES HITS STAGING`: the node caches of
/// every stage serving a data set, summed.
pub fn datasets_table(datasets: &[DatasetView]) -> Table {
    let mut t = Table::new(&[
        Column::text("NAME"),
        Column::text("POLICY"),
        Column::whole("STAGES"),
        Column::whole("CACHED"),
        Column::whole("SAMPLES"),
        Column::whole("HITS"),
        Column::whole("STAGING"),
    ]);
    for d in datasets {
        let lost = d.stages.iter().filter(|s| s.state == "lost").count();
        let stages = match lost {
            0 => d.stages.len().to_string(),
            lost => format!("{} ({lost} lost)", d.stages.len() - lost),
        };
        t.row(vec![
            d.name.clone(),
            d.policy.clone().unwrap_or_else(|| "-".into()),
            stages,
            human::bytes(d.cached_bytes() as f64),
            d.cached_samples().to_string(),
            d.hit_ratio().map_or_else(|| "-".to_owned(), human::percent),
            staging_word(d),
        ]);
    }
    t
}

/// Where the stages serving the data set are with its latest staging
/// round (`sluicectl describe dataset` names the round): `-` (none),
/// `running 1/2` (stages finished of those asked, while any is not),
/// `done`, or each end and how many stages came to it (`done 1, full 1`).
/// A round no one asked for with `sluicectl stage` is the preload of a
/// data set a job reads (`preload done`), on the stages where one does. A
/// lost stage that had not finished the round is not waited for.
pub fn staging_word(d: &DatasetView) -> String {
    fn reported(s: &DatasetOnStageView) -> Option<&StagingView> {
        s.cache.as_ref().and_then(|c| c.staging.as_ref())
    }
    let asked = d.staging_round;
    let round = match asked {
        0 => d
            .stages
            .iter()
            .filter_map(|s| reported(s).map(|p| p.round))
            .max()
            .unwrap_or(0),
        asked => asked,
    };
    let prefix = match round {
        0 => return "-".to_owned(),
        PRELOAD_ROUND => "preload ",
        _ => "",
    };
    let unfinished = |state: &str| matches!(state, "running" | "pending");
    let states: Vec<&str> = d
        .stages
        .iter()
        .filter_map(|s| {
            match reported(s) {
                Some(p) if p.round == round => Some(p.state.as_str()),
                // A stage asked that has not begun it; one never asked is not
                // counted.
                _ => (asked > 0).then_some("pending"),
            }
            .filter(|state| s.state != "lost" || !unfinished(state))
        })
        .collect();
    if states.is_empty() {
        return format!("{prefix}no stage serves it");
    }
    let finished = states.iter().filter(|s| !unfinished(s)).count();
    if finished < states.len() {
        return format!("{prefix}running {finished}/{}", states.len());
    }
    let mut ends: Vec<(&str, usize)> = Vec::new();
    for state in states {
        match ends.iter_mut().find(|(s, _)| *s == state) {
            Some((_, n)) => *n += 1,
            None => ends.push((state, 1)),
        }
    }
    match ends.as_slice() {
        [(state, _)] => format!("{prefix}{state}"),
        _ => {
            let ends: Vec<String> = ends.iter().map(|(s, n)| format!("{s} {n}")).collect();
            format!("{prefix}{}", ends.join(", "))
        }
    }
}

/// `yes` when the desired version is acknowledged, `nacked` when the
/// stage rejected a later one, `pending` while it has not answered.
pub fn sync_word(stage: &StageView) -> &'static str {
    if stage.in_sync {
        "yes"
    } else if stage.last_nack.is_some() {
        "nacked"
    } else {
        "pending"
    }
}

#[cfg(test)]
mod tests {
    use sluice_proto::v1;

    use super::*;

    fn stage(id: &str, desired: u64, acked: u64) -> StageView {
        StageView::from(v1::Stage {
            id: id.into(),
            node: "node-a".into(),
            state: v1::StageState::Connected as i32,
            desired_version: desired,
            acked_version: acked,
            last_seen_unix_millis: 1_000,
            jobs: vec!["a".into(), "b".into()],
            ..v1::Stage::default()
        })
    }

    #[test]
    fn the_stages_table_reads_as_documented() {
        let table = Listed::Stages(vec![stage("node-a-0", 3, 3), stage("node-a-1", 4, 3)]);
        assert_eq!(
            table.render(Format::Table, 5_000),
            "\
ID        NODE    STATE      DESIRED  ACKED  SYNC     JOBS  SEEN
node-a-0  node-a  connected  3        3      yes      2     4s
node-a-1  node-a  connected  4        3      pending  2     4s
"
        );
    }

    #[test]
    fn long_names_still_fit_80_columns() {
        let long = "a-stage-id-that-goes-on-and-on-".repeat(4);
        let listed = Listed::Stages(vec![stage(&long, 12_345, 12_344)]);
        let text = listed.render(Format::Table, 5_000);
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{line:?}");
        }
        let job = JobView::from(v1::Job {
            id: long.clone(),
            policy: long.clone(),
            pool: long,
            throughput_bytes_per_second: 1e12,
            stall_fraction: 1.0,
            stages: vec![v1::JobStage::default(); 3],
            ..v1::Job::default()
        });
        let text = Listed::Jobs(vec![job]).render(Format::Table, 0);
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{line:?}");
        }
    }

    fn dataset(name: &str, round: u64, staging: &[(&str, u64, &str)]) -> DatasetView {
        let stages = staging
            .iter()
            .map(|(stage, round, state)| v1::DatasetOnStage {
                stage: (*stage).into(),
                state: v1::StageState::Connected as i32,
                memory_capacity_bytes: 1 << 30,
                disk_capacity_bytes: 0,
                cache: Some(v1::DatasetCacheTelemetry {
                    memory_bytes: 50 << 20,
                    entries: 500,
                    hits: 3,
                    misses: 1,
                    staging: (*round > 0).then(|| v1::StagingProgress {
                        round: *round,
                        state: (*state).into(),
                        ..v1::StagingProgress::default()
                    }),
                    ..v1::DatasetCacheTelemetry::default()
                }),
            })
            .collect();
        DatasetView::from(v1::Dataset {
            name: name.into(),
            policy: String::new(),
            staging_round: round,
            stages,
        })
    }

    #[test]
    fn the_datasets_table_sums_the_caches_and_says_where_staging_is() {
        let listed = Listed::Datasets(vec![
            dataset(
                "imagenet",
                3,
                &[("a", 3, "done"), ("b", 3, "running"), ("c", 2, "done")],
            ),
            dataset("coco", 2, &[("a", 2, "done"), ("b", 2, "full")]),
            dataset("new", 0, &[("a", 0, "")]),
            dataset("read", 0, &[("a", 1, "running"), ("b", 0, "")]),
            dataset("gone", 4, &[]),
        ]);
        assert_eq!(
            listed.render(Format::Table, 0),
            "\
NAME      POLICY  STAGES  CACHED    SAMPLES  HITS   STAGING
imagenet  -       3       150 MiB   1500     75.0%  running 1/3
coco      -       2       100 MiB   1000     75.0%  done 1, full 1
new       -       1       50.0 MiB  500      75.0%  -
read      -       2       100 MiB   1000     75.0%  preload running 0/1
gone      -       0       0 B       0        -      no stage serves it
"
        );
        // A lost stage that had not finished is not waited for.
        let mut lost = dataset(
            "lost",
            5,
            &[("a", 5, "done"), ("b", 4, "done"), ("c", 5, "running")],
        );
        lost.stages[1].state = "lost";
        assert_eq!(staging_word(&lost), "running 1/2");
        lost.stages[2].state = "lost";
        assert_eq!(staging_word(&lost), "done");
        // Long names and mixed ends still fit.
        let long = "a-data-set-with-a-name-that-goes-on-and-on".repeat(2);
        let mut wide = dataset(
            &long,
            9,
            &[("a", 9, "done"), ("b", 9, "full"), ("c", 9, "failed")],
        );
        wide.policy = Some(long.clone());
        for line in Listed::Datasets(vec![wide])
            .render(Format::Table, 0)
            .lines()
        {
            assert!(line.chars().count() <= 80, "{line:?}");
        }
        let json: serde_json::Value =
            serde_json::from_str(&listed.render(Format::Json, 0)).unwrap();
        assert_eq!(json[0]["policy"], serde_json::Value::Null);
        assert_eq!(json[0]["stages"][1]["cache"]["staging"]["state"], "running");
        assert_eq!(
            json[2]["stages"][0]["cache"]["staging"],
            serde_json::Value::Null
        );
    }

    #[test]
    fn json_is_an_array_and_yaml_the_same_data() {
        let listed = Listed::Stages(vec![stage("s", 1, 1)]);
        let json: serde_json::Value =
            serde_json::from_str(&listed.render(Format::Json, 0)).unwrap();
        let yaml: serde_json::Value =
            serde_yaml_ng::from_str(&listed.render(Format::Yaml, 0)).unwrap();
        assert_eq!(json, yaml);
        assert_eq!(json.as_array().unwrap().len(), 1);
        assert_eq!(json[0]["state"], "connected");

        let empty = Listed::Policies(Vec::new());
        assert_eq!(empty.render(Format::Json, 0), "[]\n");
    }
}
