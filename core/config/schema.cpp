#include "core/config/schema.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include <fmt/format.h>

namespace weft {

std::string SchemaEntry::section() const { return key.substr(0, key.find('.')); }
std::string SchemaEntry::name() const { return key.substr(key.find('.') + 1); }

const SchemaSection* Schema::find_section(const std::string& name) const {
  for (const auto& section : sections)
    if (section.name == name) return &section;
  return nullptr;
}

const SchemaEntry* Schema::find_key(const std::string& key) const {
  for (const auto& entry : entries)
    if (entry.key == key) return &entry;
  return nullptr;
}

std::string describe_type(ValueType type) {
  switch (type) {
    case ValueType::Int: return "an integer";
    case ValueType::Float: return "a float";
    case ValueType::Bool: return "a boolean";
    case ValueType::String: return "a string";
    case ValueType::StringList: return "a list of strings";
  }
  return "?";
}

std::string type_name(ValueType type) {
  switch (type) {
    case ValueType::Int: return "int";
    case ValueType::Float: return "float";
    case ValueType::Bool: return "bool";
    case ValueType::String: return "string";
    case ValueType::StringList: return "string list";
  }
  return "?";
}

namespace {

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f)
          out += fmt::format("\\u{:04X}", c);
        else
          out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Shortest decimal that reads back as the same double, always with a '.' or exponent.
std::string float_to_toml(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? separator : "") + items[i];
  return out;
}

std::string bound_to_string(double v) {
  return v == std::floor(v) && std::abs(v) < 1e15 ? fmt::format("{}", static_cast<int64_t>(v))
                                                  : fmt::format("{}", v);
}

}  // namespace

std::string describe_range(const SchemaEntry& entry) {
  const std::string low = entry.min ? fmt::format("{} {}", entry.min_exclusive ? ">" : ">=", bound_to_string(*entry.min)) : "";
  const std::string high = entry.max ? fmt::format("{} {}", entry.max_exclusive ? "<" : "<=", bound_to_string(*entry.max)) : "";
  if (entry.min && entry.max && !entry.min_exclusive && !entry.max_exclusive) {
    return fmt::format("between {} and {}", bound_to_string(*entry.min), bound_to_string(*entry.max));
  }
  if (!low.empty() && !high.empty()) return low + " and " + high;
  return low + high;
}

namespace {

// "one of: "a", "b"; min 0; max 1 (excluded)" - the constraints of an entry, empty when it has none.
std::string constraints(const SchemaEntry& entry) {
  std::vector<std::string> parts;
  if (!entry.choices.empty()) {
    std::vector<std::string> quoted;
    for (const auto& choice : entry.choices) quoted.push_back(quote(choice));
    parts.push_back("one of " + join(quoted, ", "));
  }
  if (entry.min) parts.push_back("min " + bound_to_string(*entry.min) + (entry.min_exclusive ? " (excluded)" : ""));
  if (entry.max) parts.push_back("max " + bound_to_string(*entry.max) + (entry.max_exclusive ? " (excluded)" : ""));
  return join(parts, "; ");
}

// Escapes what would break a table cell or be read as HTML.
std::string markdown_cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += "\\|";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string value_to_toml(const ConfigValue& value) {
  struct Visitor {
    std::string operator()(int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const { return float_to_toml(v); }
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(const std::string& v) const { return quote(v); }
    std::string operator()(const std::vector<std::string>& v) const {
      std::vector<std::string> quoted;
      for (const auto& s : v) quoted.push_back(quote(s));
      return "[" + join(quoted, ", ") + "]";
    }
  };
  return std::visit(Visitor{}, value);
}

std::string render_help(const Schema& schema) {
  std::ostringstream out;
  out << "Configuration keys (set in the TOML file or with --set section.key=value):\n";
  for (const auto& section : schema.sections) {
    out << "\n[" << section.name << "]  " << section.doc << "\n";
    for (const auto& entry : schema.entries) {
      if (entry.section() != section.name) continue;
      out << "  " << entry.key << " (" << type_name(entry.type) << ", default "
          << (entry.default_text.empty() ? value_to_toml(entry.default_value) : entry.default_text);
      const std::string limits = constraints(entry);
      if (!limits.empty()) out << "; " << limits;
      out << ")\n      " << entry.doc << "\n";
    }
  }
  return out.str();
}

std::string render_markdown_reference(const Schema& schema) {
  std::ostringstream out;
  for (const auto& section : schema.sections) {
    out << "### `[" << section.name << "]`\n\n" << section.doc << "\n\n";
    if (section.open) continue;
    out << "| Key | Type | Default | Description |\n|---|---|---|---|\n";
    for (const auto& entry : schema.entries) {
      if (entry.section() != section.name) continue;
      std::string description = entry.doc;
      const std::string limits = constraints(entry);
      if (!limits.empty()) description += " (" + limits + ")";
      out << "| `" << entry.name() << "` | " << type_name(entry.type) << " | "
          << (entry.default_text.empty() ? "`" + value_to_toml(entry.default_value) + "`" : entry.default_text) << " | "
          << markdown_cell(description) << " |\n";
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace weft
