# Injected into llama-cpp-python's CMake build by scripts/setup.sh (CMAKE_PROJECT_INCLUDE runs after each project()
# call). llama-cpp-python forces llama.cpp's "common" library on (a cache variable), but its wheel installs nothing
# of it: only libllama and the ggml libraries, which the Python bindings load. A normal variable shadows that cache
# variable (policy CMP0126, which llama-cpp-python's cmake_minimum_required(3.21) sets), so common, about half of
# the compile time, is not built.
set(LLAMA_BUILD_COMMON OFF)
