// A run configuration: TOML files with inheritance, command-line overrides, validation against a
// schema (core/config/schema.h; weft's is run_schema(), core/job/options.h) and typed access.
//
// Loading, in order:
//  1. The file is parsed. A top-level `extends = "base.toml"` (relative to the extending file's
//     directory) loads that file first, recursively to any depth; the child is deep-merged over its
//     base (tables merge key by key, every other value - lists included - replaces).
//  2. Overrides "section.key=value" are merged over the result. The value is parsed as a TOML value
//     (`3e-4`, `true`, `["q_proj","v_proj"]`, `"text"`); text that is not valid TOML (`bf16`,
//     `runs/x`) is taken as a string, and so is any value given for a string or string-list key
//     that TOML would read as another type (`train.out_dir=2024`).
//  3. The merged configuration is validated: unknown sections/keys (with a "did you mean"
//     suggestion), types, choices and min/max. Every error is a weft::Error naming the key and
//     where it came from ("configs/x.toml:12" or "--set").
#pragma once

#include <map>
#include <string>
#include <vector>
#include <toml++/toml.h>

#include "core/config/schema.h"

namespace weft {

class Config {
 public:
  // Every key of `schema` at its default; open sections empty. `schema` must outlive the Config.
  explicit Config(const Schema& schema) : schema_(&schema) {}

  // Typed access by full key ("train.lr"): the configured value, or the schema default. A key that
  // is not in the schema, or is asked for with the wrong type, is a programming error and throws
  // std::logic_error. get_float also serves Float keys set with an integer; get_string_list also
  // serves keys set to a single string (as a one-element list).
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::vector<std::string> get_string_list(const std::string& key) const;

  // Whether a file or an override set the key (rather than falling back to the default). Accepts
  // schema keys and keys inside open sections ("plugin.foo"); other keys throw std::logic_error.
  bool is_set(const std::string& key) const;

  // The key's value, whatever its type: the configured one or the schema default. A key that is
  // not in the schema throws std::logic_error.
  const ConfigValue& value(const std::string& key) const;

  // Where the key's value came from: "path/to/file.toml:LINE", "--set", or "default".
  std::string origin(const std::string& key) const;

  // A copy of an open section's raw contents (empty when the configuration has none). The table is
  // unvalidated: the consumer checks it. A name that is not an open section throws std::logic_error.
  toml::table section_table(const std::string& section) const;

  // The config sources that were read, base first (the extends chain; for load_config_text the
  // source name); empty when built from defaults and overrides only.
  const std::vector<std::string>& files() const { return files_; }

  // The full effective configuration as TOML: every schema key with its effective value, in schema
  // order, followed by the open sections. Loading it again gives the same values and hash.
  std::string to_toml() const;

  // Stable 16-hex-digit hash (weft::hash64) of to_toml().
  std::string hash() const;

 private:
  friend class ConfigBuilder;
  const SchemaEntry& entry_for(const std::string& key, ValueType type) const;
  const ConfigValue* explicit_value(const std::string& key) const;

  const Schema* schema_;
  std::map<std::string, ConfigValue> values_;      // explicitly set schema keys, normalised
  toml::table open_sections_;                      // section name -> table
  std::map<std::string, std::string> origins_;     // dotted path -> "file:line" or "--set"
  std::vector<std::string> files_;
};

// Loads a config file (see the top of this file). An empty path starts from the defaults, so
// load_config("", {"train.lr=0.1"}) builds a configuration from overrides alone.
// Throws weft::Error for: a missing or unreadable file or base (naming both files), an extends
// cycle (naming the chain), TOML syntax errors (file:line:col and the parser's description), a
// malformed override (naming it), and every validation failure described above.
Config load_config(const Schema& schema, const std::string& path, const std::vector<std::string>& overrides = {});

// Like load_config, from TOML text; `source_name` is used in messages and as the base for a
// relative `extends`.
Config load_config_text(const Schema& schema, const std::string& toml_text, const std::string& source_name,
                        const std::vector<std::string>& overrides = {});

}  // namespace weft
