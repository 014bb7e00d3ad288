#include "core/io/checkpoint_backup.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {
namespace fs = std::filesystem;

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kFormat = "weft.checkpoint-backup/1";

// The regular files under `dir`, as sorted relative paths.
std::vector<std::string> files_under(const fs::path& dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) files.push_back(fs::relative(entry.path(), dir).string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// "step-00000120" from a key "<prefix>step-00000120/...", "" for keys outside that layout.
std::string checkpoint_of(const std::string& key, const std::string& prefix) {
  if (key.rfind(prefix, 0) != 0) return "";
  const std::string rest = key.substr(prefix.size());
  const auto slash = rest.find('/');
  if (slash == std::string::npos || rest.rfind("step-", 0) != 0) return "";
  return rest.substr(0, slash);
}

// A path from a manifest (untrusted: the bucket may hold anything): relative, no "..".
bool safe_relative_path(const std::string& path) {
  if (path.empty() || path[0] == '/') return false;
  for (const auto& part : fs::path(path)) {
    if (part == ".." || part == ".") return false;
  }
  return true;
}

}  // namespace

CheckpointBackup::CheckpointBackup(const BackupOptions& options, int64_t keep_last)
    : options_(options), keep_last_(options.keep_last > 0 ? options.keep_last : keep_last) {
  location_ = S3Url::parse(options_.url, "backup.url");
  WEFT_CHECK(s3_supported(), "backup.url = '{}', but this build of weft has no S3 client (it needs libcurl >= 7.87 "
             "and OpenSSL at build time: install libcurl4-openssl-dev and libssl-dev, then build again)", options_.url);
  const auto credentials = S3Credentials::from_environment();
  WEFT_CHECK(credentials.has_value(),
             "backup.url = '{}' but no AWS credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
             "or put them in ~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE); weft never reads them "
             "from a config",
             options_.url);
  WEFT_CHECK(options_.endpoint.empty() || options_.endpoint.rfind("http://", 0) == 0 ||
                 options_.endpoint.rfind("https://", 0) == 0,
             "backup.endpoint = '{}' is not an http:// or https:// URL", options_.endpoint);
  S3Options s3;
  s3.endpoint = options_.endpoint;
  s3.region = options_.region;
  s3.credentials = *credentials;
  s3.max_send_bytes_per_second = static_cast<int64_t>(options_.max_mb_per_second * 1e6);
  client_ = std::make_unique<S3Client>(s3, location_.bucket);
  try {
    enabled_ = retry("checking the bucket", [&] { return client_->bucket_exists(); });
    if (!enabled_) {
      spdlog::warn("backup: bucket '{}' does not exist at {}; checkpoints are kept locally only in this run",
                   location_.bucket, options_.endpoint.empty() ? "AWS" : options_.endpoint);
    }
  } catch (const S3Error& e) {
    unreachable_ = e.what();
    spdlog::warn("backup: cannot reach bucket '{}' ({}); checkpoints are kept locally only in this run",
                 location_.bucket, e.what());
  }
  if (enabled_) {
    spdlog::info("backup: checkpoints go to {} (credentials from {}, keep_last {})", describe(), credentials->source,
                 keep_last_);
    thread_ = std::thread([this] { worker(); });
  }
}

CheckpointBackup::~CheckpointBackup() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    if (pending_) {
      std::error_code ignored;
      fs::remove_all(pending_->snapshot, ignored);
      pending_.reset();
    }
  }
  changed_.notify_all();
  if (client_) client_->cancel();
  if (thread_.joinable()) thread_.join();
}

std::string CheckpointBackup::describe() const {
  return fmt::format("s3://{}/{}{}", location_.bucket, location_.prefix,
                     options_.endpoint.empty() ? "" : fmt::format(" at {}", options_.endpoint));
}

void CheckpointBackup::submit(const std::string& checkpoint_dir) {
  if (!enabled_) return;
  const fs::path source = checkpoint_dir;
  const std::string name = source.filename().string();
  // A name of its own: the same step can be saved twice (an epoch's end on a checkpoint step).
  const fs::path snapshot = source.parent_path() / fmt::format(".tmp-backup-{}-{}-{}", name, ::getpid(), ++snapshots_);
  try {
    fs::remove_all(snapshot);
    for (const std::string& file : files_under(source)) {
      fs::create_directories((snapshot / file).parent_path());
      std::error_code ec;
      fs::create_hard_link(source / file, snapshot / file, ec);
      if (ec) fs::copy_file(source / file, snapshot / file);  // a file system without hard links
    }
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(snapshot, ignored);
    spdlog::warn("backup: {} not backed up: cannot snapshot it ({})", checkpoint_dir, e.what());
    std::lock_guard lock(mutex_);
    ++failed_;
    return;
  }
  {
    std::lock_guard lock(mutex_);
    if (pending_) {
      spdlog::info("backup: {} superseded by {} before its upload started", pending_->name, name);
      std::error_code ignored;
      fs::remove_all(pending_->snapshot, ignored);
    }
    pending_ = Pending{snapshot.string(), name};
  }
  changed_.notify_all();
}

bool CheckpointBackup::drain() {
  if (!enabled_) return true;
  std::unique_lock lock(mutex_);
  if (busy_ || pending_) spdlog::info("backup: waiting for the upload to {} to finish", describe());
  changed_.wait(lock, [&] { return (!busy_ && !pending_) || stopping_; });
  if (uploaded_ > 0 || failed_ > 0) {
    spdlog::info("backup: {} checkpoint(s) uploaded ({:.1f} MB in {:.1f} s), {} failed", uploaded_,
                 uploaded_bytes_ / 1e6, upload_seconds_, failed_);
  }
  return failed_ == 0;
}

void CheckpointBackup::worker() {
  for (;;) {
    Pending job;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || pending_.has_value(); });
      if (stopping_) return;
      job = *pending_;
      pending_.reset();
      busy_ = true;
    }
    bool ok = false;
    const auto start = std::chrono::steady_clock::now();
    double bytes = 0;
    try {
      for (const std::string& file : files_under(job.snapshot)) bytes += fs::file_size(fs::path(job.snapshot) / file);
      upload(job.snapshot, job.name);
      ok = true;
      prune_bucket(job.name);
    } catch (const std::exception& e) {
      if (!ok) spdlog::warn("backup: {} not backed up: {} (the local checkpoint is intact)", job.name, e.what());
      else spdlog::warn("backup: could not delete old checkpoints from the bucket: {}", e.what());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::error_code ignored;
    fs::remove_all(job.snapshot, ignored);
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
      if (ok) {
        ++uploaded_;
        uploaded_bytes_ += bytes;
        upload_seconds_ += seconds;
      } else {
        ++failed_;
      }
    }
    if (ok) spdlog::info("backup: {} uploaded to {} ({:.1f} MB in {:.1f} s)", job.name, describe(), bytes / 1e6, seconds);
    changed_.notify_all();
  }
}

void CheckpointBackup::upload(const std::string& snapshot, const std::string& name) {
  S3Client& s3 = *client_;
  const auto with_retries = [&](const std::string& what, const auto& request) { return retry(what, request); };
  // One file: a single PUT, or a multipart upload started again when the server forgot it.
  const auto send = [&](const std::string& file, const std::string& path, int64_t size) {
    const std::string key = location_.prefix + name + "/" + file;
    // S3 takes at most 10,000 parts: larger parts for a file that would need more.
    const int64_t mib = 1024 * 1024;
    const int64_t part_size = std::max(options_.part_size_mb * mib, (size + 10000 * mib - 1) / (10000 * mib) * mib);
    if (size <= part_size) {
      with_retries(key, [&] { s3.put_file(key, path, 0, size); });
      return;
    }
    for (int64_t restart = 0;; ++restart) {
      const std::string id = with_retries(key, [&] { return s3.create_multipart_upload(key); });
      // A request of the upload that failed: NoSuchUpload when the server no longer knows the upload.
      const auto or_forgotten = [&](const auto& request) {
        try {
          return request();
        } catch (const S3Error& e) {
          if (e.code == "cancelled" || e.code == "NoSuchUpload") throw;
          bool forgotten = false;
          try {
            forgotten = !s3.multipart_upload_exists(key, id);
          } catch (const S3Error&) {  // the server is still away: retry the request
          }
          if (forgotten) throw S3Error(fmt::format("{} (upload {} forgotten)", e.what(), id), 404, "NoSuchUpload");
          throw;
        }
      };
      try {
        std::vector<std::string> etags;
        for (int64_t offset = 0; offset < size; offset += part_size) {
          const int part = static_cast<int>(offset / part_size) + 1;
          const int64_t length = std::min(part_size, size - offset);
          etags.push_back(with_retries(fmt::format("{} part {}", key, part),
                                       [&] { return or_forgotten([&] { return s3.upload_part(key, id, part, path, offset, length); }); }));
        }
        with_retries(key, [&] { or_forgotten([&] { s3.complete_multipart_upload(key, id, etags); }); });
        return;
      } catch (const S3Error& e) {
        if (e.code == "NoSuchUpload" && restart < options_.retries) {
          spdlog::warn("backup: {}: the server no longer knows its multipart upload (restarted?); sending the file "
                       "again",
                       key);
          continue;
        }
        try {
          if (e.code != "cancelled") s3.abort_multipart_upload(key, id);
        } catch (const std::exception&) {
        }
        throw;
      }
    }
  };
  nlohmann::json files = nlohmann::json::array();
  std::map<std::string, int64_t> sizes;  // key -> size
  for (const std::string& file : files_under(snapshot)) {
    const std::string path = (fs::path(snapshot) / file).string();
    const int64_t size = static_cast<int64_t>(fs::file_size(path));
    files.push_back({{"path", file}, {"size", size}, {"sha256", sha256_file_hex(path)}});
    sizes[location_.prefix + name + "/" + file] = size;
    send(file, path, size);
  }
  // Before the manifest: every file must be in the bucket at its size. A server that lost objects
  // (a restart of one that keeps them in memory) gets the missing ones again.
  for (int64_t round = 0;; ++round) {
    std::map<std::string, int64_t> present;
    for (const S3Object& object : with_retries("listing " + name, [&] { return s3.list(location_.prefix + name + "/"); })) {
      present[object.key] = object.size;
    }
    std::vector<std::string> missing;
    for (const auto& [key, size] : sizes) {
      if (!present.count(key) || present[key] != size) missing.push_back(key.substr(location_.prefix.size() + name.size() + 1));
    }
    if (missing.empty()) break;
    if (round >= options_.retries) {
      throw S3Error(fmt::format("{} of its files are still not in the bucket after {} rounds", missing.size(), round + 1), 0,
                    "missing");
    }
    spdlog::warn("backup: {} of {}'s files are not in the bucket after their upload (did the server restart?); sending "
                 "them again",
                 missing.size(), name);
    for (const std::string& file : missing) {
      const std::string path = (fs::path(snapshot) / file).string();
      send(file, path, static_cast<int64_t>(fs::file_size(path)));
    }
  }
  const nlohmann::json manifest = {{"format", kFormat}, {"checkpoint", name}, {"files", files}};
  const std::string key = location_.prefix + name + "/" + kManifest;
  with_retries(key, [&] { s3.put_object(key, manifest.dump(2) + "\n"); });
  // The bucket's `latest` names the checkpoint this run uploaded last (a prefix that also holds an
  // older run's higher steps resumes from this run's).
  with_retries(location_.prefix + "latest", [&] { s3.put_object(location_.prefix + "latest", name + "\n"); });
}

// Runs `request`, retrying what is worth retrying (S3Error::transient(), and a bucket that is
// briefly missing: a server restarting) with exponential backoff 0.5 s, 1 s, 2 s, ... (at most
// 30 s), backup.retries times; expired temporary credentials are read again first.
template <typename Request>
auto CheckpointBackup::retry(const std::string& what, const Request& request) -> decltype(request()) {
  for (int64_t attempt = 0;; ++attempt) {
    try {
      return request();
    } catch (const S3Error& e) {
      const bool expired = e.code == "ExpiredToken" || e.code == "TokenRefreshRequired";
      if ((!e.transient() && e.code != "NoSuchBucket" && !expired) || attempt >= options_.retries) throw;
      if (expired) {
        if (const auto credentials = S3Credentials::from_environment()) client_->set_credentials(*credentials);
      }
      const double wait = std::min(30.0, 0.5 * static_cast<double>(int64_t{1} << std::min<int64_t>(attempt, 6)));
      spdlog::warn("backup: {}: {} (attempt {} of {}; again in {:.1f} s)", what, e.what(), attempt + 1,
                   options_.retries + 1, wait);
      std::unique_lock lock(mutex_);
      if (changed_.wait_for(lock, std::chrono::duration<double>(wait), [&] { return stopping_; })) throw;
    }
  }
}

// Keeps the newest keep_last complete checkpoints in the bucket; deletes the older ones (manifest
// first, so none is ever taken for complete while half-deleted) and what failed uploads older than
// `newest` left.
void CheckpointBackup::prune_bucket(const std::string& newest) {
  std::map<std::string, std::vector<std::string>> keys;  // checkpoint -> its keys
  for (const S3Object& object : client_->list(location_.prefix)) {
    const std::string checkpoint = checkpoint_of(object.key, location_.prefix);
    if (!checkpoint.empty()) keys[checkpoint].push_back(object.key);
  }
  std::vector<std::string> complete;
  for (const auto& [checkpoint, objects] : keys) {
    const std::string manifest = location_.prefix + checkpoint + "/" + kManifest;
    if (std::find(objects.begin(), objects.end(), manifest) != objects.end()) complete.push_back(checkpoint);
  }
  for (const auto& [checkpoint, objects] : keys) {
    const auto at = std::find(complete.begin(), complete.end(), checkpoint);
    const bool keep = checkpoint == newest || (at != complete.end() ? complete.end() - at <= keep_last_ : checkpoint >= newest);
    if (keep) continue;
    const std::string manifest = location_.prefix + checkpoint + "/" + kManifest;
    if (at != complete.end()) client_->delete_object(manifest);
    for (const std::string& key : objects) {
      if (key != manifest) client_->delete_object(key);
    }
    spdlog::info("backup: deleted {} from the bucket (backup.keep_last = {})", checkpoint, keep_last_);
  }
  // Parts of multipart uploads that never completed (a run killed mid-file) are stored, and billed,
  // until aborted; this run's own are all complete or aborted by now.
  for (const auto& [key, id] : client_->list_multipart_uploads(location_.prefix)) {
    client_->abort_multipart_upload(key, id);
    spdlog::info("backup: aborted an unfinished multipart upload of {}", key);
  }
}

std::optional<std::string> CheckpointBackup::restore_latest(const std::string& checkpoints_dir) {
  // A bucket that could not be reached must not pass for an empty one: the run would start over.
  WEFT_CHECK(unreachable_.empty(), "checkpoint.resume = auto: no checkpoint in {} and the backup in {} cannot be "
             "reached ({}); not starting from scratch", checkpoints_dir, describe(), unreachable_);
  if (!enabled_) return std::nullopt;
  std::vector<std::string> complete;
  std::string pointed;
  try {
    for (const S3Object& object : retry("listing the backup", [&] { return client_->list(location_.prefix); })) {
      const std::string checkpoint = checkpoint_of(object.key, location_.prefix);
      if (!checkpoint.empty() && object.key == location_.prefix + checkpoint + "/" + kManifest) {
        complete.push_back(checkpoint);
      } else if (object.key == location_.prefix + "latest") {
        pointed = retry("reading latest", [&] { return client_->get_object(object.key); });
        pointed.erase(std::remove_if(pointed.begin(), pointed.end(), ::isspace), pointed.end());
      }
    }
  } catch (const S3Error& e) {
    fail("checkpoint.resume = auto: cannot list the backup in {}: {}", describe(), e.what());
  }
  if (complete.empty()) return std::nullopt;
  // The one `latest` names first, then the others from the highest step down.
  std::sort(complete.rbegin(), complete.rend());
  if (const auto at = std::find(complete.begin(), complete.end(), pointed); at != complete.end()) {
    std::rotate(complete.begin(), at, at + 1);
  }
  std::string problems;
  for (const std::string& name : complete) {
    try {
      download(name, checkpoints_dir);
      spdlog::info("checkpoint.resume = auto: {} restored from the bucket", name);
      return (fs::path(checkpoints_dir) / name).string();
    } catch (const std::exception& e) {
      spdlog::warn("checkpoint.resume = auto: cannot restore {} from {}: {}", name, describe(), e.what());
      problems += fmt::format("{}{}: {}", problems.empty() ? "" : "; ", name, e.what());
    }
  }
  fail("checkpoint.resume = auto: no checkpoint in {} could be restored ({})", describe(), problems);
}

// Downloads the complete checkpoint `name` into checkpoints_dir/name, checked against its
// manifest, and points `latest` at it; on failure nothing is left behind.
void CheckpointBackup::download(const std::string& name, const std::string& checkpoints_dir) {
  const fs::path root = checkpoints_dir, target = root / name;
  const fs::path staged = root / fmt::format(".tmp-download-{}-{}", name, ::getpid());
  spdlog::info("checkpoint.resume = auto: no checkpoint in {}; downloading {} from {}", checkpoints_dir, name,
               describe());
  try {
    const std::string manifest_key = location_.prefix + name + "/" + kManifest;
    const auto manifest = nlohmann::json::parse(retry(manifest_key, [&] { return client_->get_object(manifest_key); }));
    WEFT_CHECK(manifest.is_object() && manifest.value("format", "") == kFormat && manifest.contains("files") &&
                   manifest["files"].is_array(),
               "s3://{}/{} is not a weft backup manifest ({})", location_.bucket, manifest_key, kFormat);
    fs::create_directories(staged);
    for (const auto& file : manifest["files"]) {
      const std::string path = file.at("path").get<std::string>();
      WEFT_CHECK(safe_relative_path(path), "s3://{}/{} names the file '{}', which is not a relative path inside the "
                 "checkpoint", location_.bucket, manifest_key, path);
      const fs::path local = staged / path;
      fs::create_directories(local.parent_path());
      const std::string key = location_.prefix + name + "/" + path;
      retry(key, [&] { client_->get_to_file(key, local.string()); });
      const auto size = static_cast<int64_t>(fs::file_size(local));
      WEFT_CHECK(size == file.at("size").get<int64_t>() && sha256_file_hex(local.string()) == file.at("sha256"),
                 "s3://{}/{} does not match its manifest (size {}, {} expected, or its SHA-256 differs)",
                 location_.bucket, key, size, file.at("size").get<int64_t>());
    }
    sync_directory(staged.string());
    fs::remove_all(target);
    fs::rename(staged, target);
    sync_directory(root.string());
    write_file_atomically((root / "latest").string(), name + "\n");
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staged, ignored);
    throw;
  }
}

}  // namespace weft
