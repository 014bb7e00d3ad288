// The host services that read the plugin's [plugin] settings.
#include "core/plugin/host_services.h"

namespace weft {
namespace host {


template <typename T>
std::string setting_text(T value) {
  if constexpr (std::is_same_v<T, int32_t>) {
    return value ? "true" : "false";
  } else {
    return fmt::format("{}", value);
  }
}

template <typename T>
weft_status* config_value(weft_host* host, const char* key, T fallback, T* out, const char* type_name) {
  return guarded([&] {
    WEFT_CHECK(key && out, "config: null key or output");
    auto& s = state_of(host);
    const auto* node = s.config.get(key);
    if (!node) {
      *out = fallback;
      s.record_setting(key, setting_text(*out));
      return;
    }
    if constexpr (std::is_same_v<T, double>) {
      if (auto v = node->value<double>()) {
        *out = *v;
        s.record_setting(key, setting_text(*out));
        return;
      }
    } else if constexpr (std::is_same_v<T, int32_t>) {
      if (auto v = node->value<bool>()) {
        *out = *v ? 1 : 0;
        s.record_setting(key, setting_text(*out));
        return;
      }
    } else {
      if (auto v = node->value<int64_t>()) {
        *out = *v;
        s.record_setting(key, setting_text(*out));
        return;
      }
    }
    throw Error(fmt::format("config key 'plugin.{}' must be {}", key, type_name));
  });
}

weft_status* config_int(weft_host* h, const char* key, int64_t fallback, int64_t* out) {
  return config_value<int64_t>(h, key, fallback, out, "an integer");
}
weft_status* config_float(weft_host* h, const char* key, double fallback, double* out) {
  return config_value<double>(h, key, fallback, out, "a number");
}
weft_status* config_bool(weft_host* h, const char* key, int32_t fallback, int32_t* out) {
  return config_value<int32_t>(h, key, fallback, out, "a boolean");
}
weft_status* config_string(weft_host* host, const char* key, const char* fallback, const char** out) {
  return guarded([&] {
    WEFT_CHECK(key && out, "config: null key or output");
    auto& s = state_of(host);
    auto* node = s.config.get(key);
    if (!node) {
      *out = fallback;
      s.record_setting(key, fallback ? fmt::format("\"{}\"", fallback) : "none");
      return;
    }
    const auto* str = node->as_string();
    WEFT_CHECK(str != nullptr, "config key 'plugin.{}' must be a string", key);
    *out = str->get().c_str();  // lives in the config table for the run
    s.record_setting(key, fmt::format("\"{}\"", str->get()));
  });
}

weft_status* config_int_list(weft_host* host, const char* key, int64_t* out, int32_t capacity, int32_t* count_out) {
  return guarded([&] {
    WEFT_CHECK(key && count_out && capacity >= 0 && (capacity == 0 || out), "config_int_list: invalid arguments");
    auto& s = state_of(host);
    auto* node = s.config.get(key);
    if (!node) {
      *count_out = 0;
      s.record_setting(key, "[]");
      return;
    }
    const auto* array = node->as_array();
    WEFT_CHECK(array != nullptr, "config key 'plugin.{}' must be an array of integers", key);
    std::vector<int64_t> values;
    for (const auto& element : *array) {
      const auto* value = element.as_integer();
      WEFT_CHECK(value != nullptr, "config key 'plugin.{}' must be an array of integers", key);
      values.push_back(value->get());
    }
    for (int32_t i = 0; i < capacity && i < static_cast<int32_t>(values.size()); ++i) out[i] = values[i];
    *count_out = static_cast<int32_t>(values.size());
    s.record_setting(key, fmt::format("[{}]", fmt::join(values, ", ")));
  });
}

}  // namespace host
}  // namespace weft
