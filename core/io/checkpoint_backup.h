// Checkpoint backup to S3-compatible storage ([backup]): after each complete local save, a
// background thread uploads the checkpoint, so training never waits on the network.
//
// Layout in the bucket, under backup.url's prefix:
//   step-00000120/<every file of the checkpoint, same relative paths>
//   step-00000120/manifest.json   uploaded after the files: their names, sizes and SHA-256
//   latest                        the checkpoint this run uploaded last (after its manifest)
// A checkpoint without its manifest is an upload that did not finish, and is never taken for one.
// Files larger than backup.part_size_mb go as multipart uploads; every request is retried with
// exponential backoff (backup.retries), a multipart upload the server forgot (NoSuchUpload: the
// server restarted) starts that file again, and before the manifest every file is checked to be
// in the bucket at its size (a server that lost objects gets them again). A backup that still
// fails is a warning: the local
// checkpoint is never touched. backup.keep_last (default checkpoint.keep_last) applies to the
// bucket: older complete checkpoints are deleted there, manifest first, and multipart uploads left
// unfinished (a run killed mid-file) are aborted. A prefix is meant to hold one run.
// checkpoint.resume = "auto" on an out_dir without checkpoints takes the newest complete
// checkpoint from the bucket (restore_latest), each file checked against the manifest.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "core/io/s3.h"

namespace weft {

struct BackupOptions {
  std::string url;        // backup.url: "s3://bucket/prefix"; "" = no backup
  std::string endpoint;   // backup.endpoint: "" = AWS
  std::string region;     // backup.region: "" = AWS_REGION / AWS_DEFAULT_REGION / us-east-1
  int64_t keep_last = 0;  // backup.keep_last: 0 = checkpoint.keep_last
  int64_t part_size_mb = 64;
  double max_mb_per_second = 0;  // 0 = unlimited
  int64_t retries = 5;
};

class CheckpointBackup {
 public:
  // Parses the URL and finds the credentials, throwing weft::Error naming the problem (call before
  // compute starts). Then checks the bucket: when it is missing or unreachable, one warning says
  // so and this run's backup is off (enabled() false). keep_last: checkpoint.keep_last.
  CheckpointBackup(const BackupOptions& options, int64_t keep_last);
  // Cancels an upload in flight (drain() first to wait for it).
  ~CheckpointBackup();

  bool enabled() const { return enabled_; }
  std::string describe() const;  // "s3://bucket/prefix (endpoint ...)"

  // Queues the complete checkpoint `checkpoint_dir` (<out_dir>/checkpoints/step-N) and returns at
  // once. Its files are hard-linked into a snapshot (<out_dir>/checkpoints/.tmp-backup-...) first,
  // so pruning the local checkpoint does not disturb the upload. A checkpoint still queued when a
  // newer one comes is dropped: the newer supersedes it.
  void submit(const std::string& checkpoint_dir);
  // Waits for the queued uploads; returns false when one of this run's uploads failed.
  bool drain();

  // Downloads the newest complete checkpoint of the bucket (the one the bucket's `latest` names,
  // else the highest step) into `checkpoints_dir` as step-N and points `latest` at it; every
  // file's size and SHA-256 are checked against the manifest, and one that fails gives way to the
  // next older complete checkpoint. Returns its directory, or nullopt when the bucket is missing or
  // holds none. Throws weft::Error when the bucket could not be reached at start (so that a
  // network fault never passes for an empty bucket) or no checkpoint could be restored (nothing
  // is left in `checkpoints_dir` then).
  std::optional<std::string> restore_latest(const std::string& checkpoints_dir);

  // Checkpoints of this run whose backup failed (drain() first for the final count).
  int64_t failed() const { return failed_; }

 private:
  void worker();
  void upload(const std::string& snapshot, const std::string& name);
  void prune_bucket(const std::string& newest);
  void download(const std::string& name, const std::string& checkpoints_dir);
  template <typename Request>
  auto retry(const std::string& what, const Request& request) -> decltype(request());

  BackupOptions options_;
  S3Url location_;
  std::unique_ptr<S3Client> client_;  // used by the worker thread, or by restore_latest before it has work
  bool enabled_ = false;
  std::string unreachable_;  // why the bucket could not be reached at start ("" = it could, or it is missing)
  int64_t snapshots_ = 0;
  int64_t keep_last_ = 0;

  std::mutex mutex_;
  std::condition_variable changed_;
  struct Pending {
    std::string snapshot, name;
  };
  std::optional<Pending> pending_;
  bool busy_ = false, stopping_ = false;
  int64_t uploaded_ = 0, failed_ = 0;
  double uploaded_bytes_ = 0, upload_seconds_ = 0;
  std::thread thread_;
};

}  // namespace weft
