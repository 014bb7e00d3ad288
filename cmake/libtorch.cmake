# LibTorch for weft, found in one place. tools/setup.sh points CMAKE_PREFIX_PATH at PyTorch's
# wheel (WEFT_LIBTORCH=wheel, the default: the LibTorch users install with `pip install torch`);
# any other LibTorch 2.x (an unzipped libtorch, a conda or pip torch/ folder) works the same way
# through WEFT_LIBTORCH=DIR, CMAKE_PREFIX_PATH or Torch_DIR.
#
# weft needs LibTorch WEFT_LIBTORCH_MIN (2.5) or newer, the oldest whose APIs it uses:
# at::scaled_dot_product_attention's enable_gqa (2.5), TCPStoreOptions::useLibUV and
# c10d::Backend::shutdown (2.4), aten::_fused_adamw_ on the CPU (2.4). An older one is refused
# here, before anything compiles.
#
# Sets TORCH_LIBRARIES (link it), WEFT_TORCH_CUDA and WEFT_TORCH_NCCL (ON when LibTorch's CUDA
# and NCCL paths are compiled into weft), compiles every C++ target with OpenMP where LibTorch's
# loops run on it (below), and prints one line saying what was found.
#
# A CUDA build of LibTorch (every Linux wheel on PyPI) needs a CUDA toolkit for find_package(Torch);
# on a machine without one weft builds CPU only against the same LibTorch's CPU libraries
# (libtorch_cpu, libc10), saying so. WEFT_CUDA=OFF asks for that CPU build explicitly.

set(WEFT_LIBTORCH_MIN 2.5)
option(WEFT_CUDA "Compile LibTorch's CUDA and NCCL paths when LibTorch and the machine have them" ON)

# Where is TorchConfig.cmake (as find_package would look), and was that LibTorch built with CUDA?
set(WEFT_TORCH_CMAKE_DIR "")
foreach(_p ${Torch_DIR} ${CMAKE_PREFIX_PATH} $ENV{CMAKE_PREFIX_PATH} /usr/local /usr)
  foreach(_d ${_p} ${_p}/Torch ${_p}/share/cmake/Torch ${_p}/lib/cmake/Torch ${_p}/lib/x86_64-linux-gnu/cmake/Torch)
    if(NOT WEFT_TORCH_CMAKE_DIR AND EXISTS "${_d}/TorchConfig.cmake")
      get_filename_component(WEFT_TORCH_CMAKE_DIR "${_d}" ABSOLUTE)
    endif()
  endforeach()
endforeach()
if(NOT WEFT_TORCH_CMAKE_DIR)
  message(FATAL_ERROR "weft: no LibTorch found (TorchConfig.cmake): run tools/setup.sh, or pass "
    "-DCMAKE_PREFIX_PATH=<the prefix of a LibTorch> (for a wheel: python -c 'import torch.utils; "
    "print(torch.utils.cmake_prefix_path)')")
endif()
get_filename_component(_weft_torch_prefix "${WEFT_TORCH_CMAKE_DIR}/../../.." ABSOLUTE)
# The version, before TorchConfig.cmake (which would fail on an old LibTorch in other ways).
set(PACKAGE_FIND_VERSION ${WEFT_LIBTORCH_MIN})
include("${WEFT_TORCH_CMAKE_DIR}/TorchConfigVersion.cmake")
set(_weft_found_version ${PACKAGE_VERSION})
unset(PACKAGE_FIND_VERSION)
if(_weft_found_version VERSION_LESS WEFT_LIBTORCH_MIN)
  message(FATAL_ERROR "weft: LibTorch ${_weft_found_version} found at ${_weft_torch_prefix}; weft needs LibTorch "
    "${WEFT_LIBTORCH_MIN} or newer (tools/setup.sh installs PyTorch's wheel; WEFT_LIBTORCH=DIR names another 2.x)")
endif()
set(_weft_torch_is_cuda OFF)
if(EXISTS "${WEFT_TORCH_CMAKE_DIR}/../Caffe2/Caffe2Config.cmake")
  file(STRINGS "${WEFT_TORCH_CMAKE_DIR}/../Caffe2/Caffe2Config.cmake" _weft_cuda_line
    REGEX "^  set\\(CAFFE2_USE_CUDA ON\\)")
  if(_weft_cuda_line)
    set(_weft_torch_is_cuda ON)
  endif()
endif()
set(_weft_have_toolkit OFF)
if(_weft_torch_is_cuda AND WEFT_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(_weft_have_toolkit ON)
  endif()
endif()

if(_weft_torch_is_cuda AND NOT _weft_have_toolkit)
  # TorchConfig.cmake would stop here without nvcc: import the CPU half of the same LibTorch.
  if(WEFT_CUDA)
    message(STATUS "weft: no CUDA toolkit (nvcc) on this machine: building CPU only against the CUDA "
      "LibTorch at ${_weft_torch_prefix} (its CUDA and NCCL paths are not compiled)")
  else()
    message(STATUS "weft: WEFT_CUDA=OFF: building CPU only against ${_weft_torch_prefix}")
  endif()
  set(Torch_VERSION ${_weft_found_version})
  set(TORCH_INSTALL_PREFIX ${_weft_torch_prefix})
  add_library(weft_torch_cpu INTERFACE)
  target_include_directories(weft_torch_cpu SYSTEM INTERFACE
    ${_weft_torch_prefix}/include ${_weft_torch_prefix}/include/torch/csrc/api/include)
  target_link_libraries(weft_torch_cpu INTERFACE
    ${_weft_torch_prefix}/lib/libtorch_cpu.so ${_weft_torch_prefix}/lib/libc10.so)
  # What Caffe2Targets.cmake gives torch_cpu's users on Linux.
  target_compile_definitions(weft_torch_cpu INTERFACE USE_DISTRIBUTED USE_C10D_GLOO)
  set(TORCH_LIBRARIES weft_torch_cpu)
  set(TORCH_LIBRARY ${_weft_torch_prefix}/lib/libtorch_cpu.so)
else()
  # TorchConfig.cmake's find_library searches CMAKE_PREFIX_PATH and the system before its own
  # lib/: put its own first.
  list(PREPEND CMAKE_PREFIX_PATH ${_weft_torch_prefix})
  find_package(Torch REQUIRED PATHS ${WEFT_TORCH_CMAKE_DIR} NO_DEFAULT_PATH)
endif()

# A LibTorch's headers with another LibTorch's libraries link and then crash: TorchConfig.cmake's
# find_library also searches the system's directories, where a system LibTorch may be.
get_filename_component(_weft_torch_lib "${TORCH_LIBRARY}" REALPATH)
get_filename_component(_weft_torch_root "${TORCH_INSTALL_PREFIX}" REALPATH)
if(NOT _weft_torch_lib MATCHES "^${_weft_torch_root}/")
  message(FATAL_ERROR "weft: LibTorch's headers are from ${TORCH_INSTALL_PREFIX} but its library "
    "${TORCH_LIBRARY} is not: put the LibTorch root (for a wheel, the folder of torch/__init__.py) "
    "first in CMAKE_PREFIX_PATH (tools/setup.sh does)")
endif()

set(WEFT_TORCH_CUDA OFF)
set(WEFT_TORCH_NCCL OFF)
if(TARGET torch_cuda)
  set(WEFT_TORCH_CUDA ON)
  get_target_property(_weft_cuda_defs torch_cuda INTERFACE_COMPILE_DEFINITIONS)
  if("USE_C10D_NCCL" IN_LIST _weft_cuda_defs)
    set(WEFT_TORCH_NCCL ON)
  endif()
endif()

# LibTorch's wheel runs its CPU operators' loops on OpenMP (AT_PARALLEL_OPENMP; torch/lib holds its
# libgomp.so.1). at::parallel_for, an inline template in ATen's headers, splits a loop over threads
# only where the including file was compiled with OpenMP (_OPENMP): without it weft's own CPU
# kernels (core/model/kernels.cpp) ran every loop on the calling thread whatever train.threads said.
# Every C++ target compiles with OpenMP (one definition of at::parallel_for in every object, the
# shared precompiled header's included) and needs libgomp.so.1 by its soname, which the binaries'
# RUNPATH (LibTorch's lib/) resolves to LibTorch's own copy: one OpenMP runtime per process
# (FusedKernels.WeftsLoopsRunOnLibTorchsThreads), sized by at::set_num_threads. A LibTorch on its
# own thread pool (AT_PARALLEL_NATIVE) splits loops without this.
file(STRINGS "${TORCH_INSTALL_PREFIX}/include/ATen/Config.h" _weft_at_openmp REGEX "^#define AT_PARALLEL_OPENMP 1")
if(_weft_at_openmp)
  find_package(OpenMP REQUIRED COMPONENTS CXX)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${OpenMP_CXX_FLAGS}>")
  link_libraries(OpenMP::OpenMP_CXX)
endif()

# The wheel ships fmt 12's headers in its include folder, ahead of the system's; spdlog (Debian)
# is built on the system's fmt 9. Every weft target sees the system's fmt first.
find_path(WEFT_FMT_INCLUDE_DIR fmt/format.h PATHS ${WEFT_DEPS_PREFIX}/usr/include /usr/include /usr/local/include
  NO_DEFAULT_PATH)
if(EXISTS "${TORCH_INSTALL_PREFIX}/include/fmt" AND WEFT_FMT_INCLUDE_DIR)
  set(_weft_fmt_first ${PROJECT_BINARY_DIR}/fmt-first)
  file(MAKE_DIRECTORY ${_weft_fmt_first})
  file(CREATE_LINK ${WEFT_FMT_INCLUDE_DIR}/fmt ${_weft_fmt_first}/fmt SYMBOLIC)
  include_directories(BEFORE SYSTEM ${_weft_fmt_first})
endif()

message(STATUS "weft: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}; CUDA ${WEFT_TORCH_CUDA}, "
  "NCCL ${WEFT_TORCH_NCCL}")

# PyTorch's wheels build libtorch.so with a static copy of libstdc++'s std::filesystem and export
# it (64 symbols, unversioned). Linked first, libtorch.so would then answer weft's calls to
# std::filesystem (remove_all jumped to address 0 in test_config). Putting libstdc++ first in every
# weft binary's DT_NEEDED keeps the system's libstdc++ first in the symbol search order.
add_link_options("LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
